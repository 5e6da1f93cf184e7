//! Benchmarks behind `troupe bench`: each prints one line per figure (`name value`), or one JSON
//! object with the same names as keys.

pub mod rpc;

/// Prints figures as `name value` lines, or as one JSON object.
pub fn print_figures(figures: &[(String, f64)], json: bool) {
    if json {
        let m: serde_json::Map<String, serde_json::Value> = figures
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!((v * 10.0).round() / 10.0)))
            .collect();
        println!("{}", serde_json::Value::Object(m));
    } else {
        for (k, v) in figures {
            println!("{k} {v:.1}");
        }
    }
}
