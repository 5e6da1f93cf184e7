//! Reading and comparing bearer keys: one parser for every Troupe HTTP server (gateway, control
//! server, reference engine) and the gRPC host, so they agree on what a key is.
//!
//! RFC 7235 makes the scheme case-insensitive (`Bearer`, `bearer`, `BEARER` are one scheme)
//! and separates it from the credentials by one or more spaces; clients differ in which they
//! send, and a refused lowercase `bearer` is a 401 nobody can explain.

use http::HeaderMap;
use http::header::AUTHORIZATION;

/// The credentials of an `Authorization: Bearer <key>` value, or `None` for another scheme or
/// no credentials.
pub fn bearer_value(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let key = rest.trim_start_matches(' ').trim_end();
    (!key.is_empty()).then_some(key)
}

/// The bearer key of a request's `Authorization` header, if it has one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    bearer_value(headers.get(AUTHORIZATION)?.to_str().ok()?)
}

/// Compares in time independent of where the first difference is (so response timing does not
/// reveal how much of a guessed key was right).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries `key` as its bearer key.
pub fn has_key(headers: &HeaderMap, key: &str) -> bool {
    bearer(headers).is_some_and(|g| same(g.as_bytes(), key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_is_case_insensitive_and_the_key_is_exact() {
        for v in ["Bearer k1", "bearer k1", "BEARER   k1", "BeArEr k1 "] {
            assert_eq!(bearer_value(v), Some("k1"), "{v}");
        }
        for v in ["Basic k1", "Bearer", "Bearer ", "Bearerk1", "k1", ""] {
            assert_eq!(bearer_value(v), None, "{v}");
        }
        assert_eq!(bearer_value("Bearer K1"), Some("K1"));
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
    }
}
