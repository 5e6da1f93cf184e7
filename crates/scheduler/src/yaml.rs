//! Bounds on YAML input, checked before a parser sees it.
//!
//! Configs are small; a hostile or broken one (a 100k-deep `[[[[…`, a multi-gigabyte file) must
//! be refused in bounded time and memory with a clear message, not after seconds of parsing.
//! Every YAML Troupe reads (`troupe serve`/`run` configs, allocation configs, `key=value`
//! overrides) goes through [`check`] first.

/// Largest YAML document accepted, in bytes.
pub const MAX_BYTES: usize = 1 << 20;

/// Deepest nesting of flow collections (`[...]`, `{...}`) accepted.
pub const MAX_FLOW_DEPTH: usize = 64;

/// Refuses documents over [`MAX_BYTES`] or with flow collections nested deeper than
/// [`MAX_FLOW_DEPTH`] (outside quoted strings and comments). One linear pass.
pub fn check(text: &str) -> Result<(), String> {
    if text.len() > MAX_BYTES {
        return Err(format!(
            "the YAML is {} bytes; at most {MAX_BYTES} are accepted (a config is a few KiB)",
            text.len()
        ));
    }
    let (mut depth, mut quote, mut comment) = (0usize, None::<char>, false);
    let mut prev = '\n';
    let mut chars = text.chars().peekable();
    let mut line = 1usize;
    while let Some(c) = chars.next() {
        if c == '\n' {
            line += 1;
            comment = false;
        }
        match quote {
            _ if comment => {}
            Some('"') if c == '\\' => {
                chars.next();
            }
            Some(q) if c == q => {
                // '' inside a single-quoted string is an escaped quote.
                if q == '\'' && chars.peek() == Some(&'\'') {
                    chars.next();
                } else {
                    quote = None;
                }
            }
            Some(_) => {}
            None => match c {
                '#' if prev.is_whitespace() => comment = true,
                '"' | '\'' => quote = Some(c),
                '[' | '{' => {
                    depth += 1;
                    if depth > MAX_FLOW_DEPTH {
                        return Err(format!(
                            "the YAML nests `[`/`{{` more than {MAX_FLOW_DEPTH} deep (line {line})"
                        ));
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            },
        }
        prev = c;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_or_huge_documents_are_refused_and_ordinary_ones_pass() {
        assert!(check("a: [1, [2, {b: \"[[[[\"}]]  # [[[[\nc: '[['' '\n").is_ok());
        let deep = format!("a: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = check(&deep).unwrap_err();
        assert!(e.contains("64 deep"), "{e}");
        let ok = format!("a: {}{}", "[".repeat(64), "]".repeat(64));
        assert!(check(&ok).is_ok());
        let huge = "a: 1\n".repeat(MAX_BYTES / 5 + 1);
        assert!(check(&huge).unwrap_err().contains("bytes"));
    }
}
