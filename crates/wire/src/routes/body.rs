//! Reading an endpoint's JSON request: the one parser the engine and the gateway share, so bad
//! input is answered the same way on both, in the error envelope, naming the field.

use serde::de::DeserializeOwned;

use crate::ApiError;

/// Parses a JSON body into `T`, naming the field that is wrong (`invalid body: tags[1]: ...`);
/// an empty body is `{}`. The error is a control endpoint's 400.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    let de = &mut serde_json::Deserializer::from_slice(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = if path == "." {
            String::new()
        } else {
            format!("{path}: ")
        };
        ApiError::bad_request(format!("invalid body: {at}{inner}")).control()
    })
}

/// Reads a JSON value that arrived inside another body (an RPC's argument, a list's entry)
/// as `T`, naming it (`what`) and the field that is wrong. The error is a control endpoint's
/// 400.
pub fn from_value<T: DeserializeOwned>(v: serde_json::Value, what: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = if path == "." {
            what.to_string()
        } else {
            format!("{what}.{path}")
        };
        ApiError::bad_request(format!("invalid {at}: {inner}")).control()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sglang::MemoryTags;

    #[test]
    fn errors_name_the_field() {
        let m: MemoryTags = parse(b" ").unwrap();
        assert_eq!(m.tags, None);
        let e = parse::<MemoryTags>(br#"{"tags": ["a", 1]}"#).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("tags[1]"), "{}", e.message);
        assert!(e.control);
    }
}
