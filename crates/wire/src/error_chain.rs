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

/// Longest run of digits a message shows whole.
const MAX_DIGITS: usize = 24;
/// Longest message shown whole, in characters.
const MAX_MESSAGE: usize = 4096;

/// `msg` fit to show: every run of more than 24 digits (a number pasted as a size, echoed back
/// by a parser) cut to its first 12 and a count, and the whole cut at 4096 characters. Error
/// messages quote what was wrong; a 300-digit number or a megabyte of input does not help.
pub fn clip(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len().min(MAX_MESSAGE + 32));
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        if run.len() > MAX_DIGITS {
            out.push_str(&run[..12]);
            out.push_str(&format!("…({} digits)", run.len()));
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in msg.chars() {
        if c.is_ascii_digit() {
            run.push(c);
            continue;
        }
        flush(&mut run, &mut out);
        out.push(c);
    }
    flush(&mut run, &mut out);
    if out.chars().count() > MAX_MESSAGE {
        let cut: String = out.chars().take(MAX_MESSAGE).collect();
        return format!("{cut}… (message cut)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{clip, error_chain};

    #[test]
    fn long_numbers_and_messages_are_clipped() {
        let n = "9".repeat(300);
        let c = clip(&format!("bad value `{n}` for x"));
        assert_eq!(c, "bad value `999999999999…(300 digits)` for x");
        assert_eq!(clip("port 30000 of 4294967296"), "port 30000 of 4294967296");
        assert!(clip(&"x".repeat(10_000)).len() < 4200);
    }

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
