//! Benchmarks behind `troupe bench`: each prints one line per figure (`name value`), or one JSON
//! object with the same names as keys.

pub mod agent;
pub mod chaos;
pub mod fixture;
pub mod fp8;
pub mod gateway;
mod gateway_backends;
mod gateway_session;
pub mod proc_cpu;
pub mod rollout;
pub mod rollout_update;
pub mod rpc;
mod rpc_floor;
pub mod scale;
mod scale_checks;
pub mod stub_engine;

/// Prints figures as `name value` lines, or as one JSON object.
pub fn print_figures(figures: &[(String, f64)], json: bool) {
    if json {
        let m: serde_json::Map<String, serde_json::Value> = figures
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!(rounded(*v))))
            .collect();
        super::out(&serde_json::Value::Object(m));
    } else {
        for (k, v) in figures {
            super::out(&format!("{k} {}", rounded(*v)));
        }
    }
}

/// One decimal for large figures, three significant-ish decimals for small ones (ratios, GB/s).
fn rounded(v: f64) -> f64 {
    let scale = if v.abs() >= 100.0 { 10.0 } else { 1000.0 };
    (v * scale).round() / scale
}
