//! Secrets out of engine answers: SGLang's `/server_info` echoes its launch arguments, its admin
//! key among them, and neither the data proxy nor the fleet's `/server_info` may pass that on.

use serde_json::Value;

/// Whether a field carries a secret (`api_key`, `admin_api_key`, …).
fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.ends_with("api_key") || k.ends_with("secret") || k == "token" || k.ends_with("_token")
}

/// Replaces every secret-named field of `v` (at any depth) with `"<redacted>"` (SGLang echoes
/// its admin key in `/server_info`; the proxy and the fleet's `/server_info` never pass it on).
pub fn redact(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if is_secret(k) && !x.is_null() {
                    *x = Value::String("<redacted>".into());
                } else {
                    redact(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(redact),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn server_info_secrets_are_redacted_and_nothing_else() {
        let mut v = json!({"admin_api_key": "k", "api_key": null, "max_total_num_tokens": 4096,
            "disaggregation_mode": "decode", "internal_states": [{"bootstrap_secret": "s"}]});
        redact(&mut v);
        assert_eq!(
            v,
            json!({"admin_api_key": "<redacted>", "api_key": null, "max_total_num_tokens": 4096,
                "disaggregation_mode": "decode", "internal_states": [{"bootstrap_secret": "<redacted>"}]})
        );
    }
}
