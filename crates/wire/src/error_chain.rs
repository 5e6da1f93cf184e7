//! [`error_chain`]: an error with its causes on one line.
//!
//! Why: the client libraries' own messages stop at the outer layer (tonic's "transport error",
//! hyper's "client error (Connect)"), while the cause (connection refused, handshake failure,
//! unknown CA) is what the reader needs. One formatting for every crate that reports them.

/// `e` and its sources, `outer: inner: ...`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut m = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        m.push_str(": ");
        m.push_str(&s.to_string());
        src = s.source();
    }
    m
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug)]
    struct Outer(std::fmt::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error (Connect)")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn every_cause_is_named_in_order() {
        assert_eq!(
            error_chain(&Outer(std::fmt::Error)),
            format!("client error (Connect): {}", std::fmt::Error)
        );
        assert_eq!(error_chain(&std::fmt::Error), std::fmt::Error.to_string());
    }
}
