//! Small checks and values every test binary shares: the error envelope Troupe's servers answer
//! with, the bytes of an f32 tensor, a free port for a child process. Each had copies in two or
//! three test files; they live here once.

use serde_json::Value;

/// Asserts `v` is exactly one error envelope (OpenAI's shape, which the engine and the gateway
/// both answer with: `object: "error"`, `code`, a non-empty `message`, a `type`, a null
/// `param`, nothing else) with `code`; answers its message for further checks.
pub fn assert_envelope(v: &Value, code: u16) -> &str {
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(o.len(), 5, "{v}");
    envelope_fields(v, code)
}

/// Asserts a request was refused as bad input: status 400 and a `BadRequestError` envelope
/// whose message names what was wrong (`needle`). Unlike [`assert_envelope`], extra fields are
/// allowed: SGLang's weight routes add `success: false` to theirs, and the engine keeps it.
pub fn assert_bad_request(status: u16, err: &Value, needle: &str) {
    assert_eq!(status, 400, "{err}");
    let msg = envelope_fields(err, 400);
    assert_eq!(err["type"], "BadRequestError", "{err}");
    assert!(
        msg.contains(needle),
        "message {msg:?} should mention {needle:?}"
    );
}

/// Checks the envelope's own fields in `v` (see [`assert_envelope`]) and answers its message.
fn envelope_fields(v: &Value, code: u16) -> &str {
    assert_eq!(v["object"], "error", "{v}");
    assert_eq!(v["code"], code, "{v}");
    assert!(v["param"].is_null(), "{v}");
    assert!(v["type"].is_string(), "{v}");
    let msg = v["message"].as_str().unwrap_or("");
    assert!(!msg.is_empty(), "{v}");
    msg
}

/// The little-endian bytes of `v`: an f32 tensor as weight transports and safetensors carry it.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A port nothing listens on now (the OS's pick, released at once) for a server started in
/// another process, which cannot be handed a bound socket. Another process may take it in
/// between; a test that can bind port 0 itself should.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn envelope(message: &str) -> Value {
        json!({"object": "error", "message": message, "type": "BadRequestError", "param": null, "code": 400})
    }

    #[test]
    fn an_envelope_passes_and_answers_its_message() {
        let v = envelope("bad `x`");
        assert_eq!(assert_envelope(&v, 400), "bad `x`");
        assert_bad_request(400, &v, "`x`");
    }

    #[test]
    #[should_panic(expected = "\"detail\"")]
    fn an_extra_field_fails() {
        let mut v = envelope("bad");
        v["detail"] = json!("more");
        assert_envelope(&v, 400);
    }

    #[test]
    #[should_panic(expected = "should mention")]
    fn a_message_that_does_not_name_the_field_fails() {
        assert_bad_request(400, &envelope("bad"), "max_tokens");
    }

    #[test]
    fn f32_bytes_are_little_endian() {
        assert_eq!(f32_bytes(&[1.0, -2.0]), [0, 0, 128, 63, 0, 0, 0, 192]);
    }

    #[test]
    fn a_free_port_is_a_real_one() {
        assert_ne!(free_port(), 0);
    }
}
