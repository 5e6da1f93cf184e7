//! SGLang flags the reference engine does not take: one command line (and one config's
//! `sglang:` section) serves both `troupe:` and `sglang:` deployments, so `troupe engine`
//! drops the flags of SGLang's `ServerArgs` it has no use for (with their values) and says
//! which, once, instead of refusing to start. Flags that are neither its own nor SGLang's are
//! still errors.

use troupe_wire::engine_args::{ArgKind, EngineDialect};

/// Splits `args` (the flags after `troupe engine`) into the ones to parse and the SGLang flags
/// to ignore. `own` lists the engine's long flags (`--port`, ...).
pub fn split_foreign(args: &[String], own: &[String]) -> (Vec<String>, Vec<String>) {
    let mut keep = Vec::with_capacity(args.len());
    let mut ignored = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let (flag, inline) = match a.split_once('=') {
            Some((f, _)) if a.starts_with("--") => (f, true),
            _ => (a.as_str(), false),
        };
        let foreign = flag.starts_with("--")
            && !own.iter().any(|o| o == flag)
            && EngineDialect::Sglang.by_flag(flag).is_some();
        if !foreign {
            keep.push(a.clone());
            i += 1;
            continue;
        }
        ignored.push(flag.to_string());
        i += 1;
        if inline {
            continue;
        }
        let kind = EngineDialect::Sglang
            .by_flag(flag)
            .map_or(ArgKind::Value, |s| s.kind);
        match kind {
            ArgKind::True | ArgKind::False | ArgKind::Bool => {}
            ArgKind::List => {
                while i < args.len() && !args[i].starts_with("--") {
                    i += 1;
                }
            }
            ArgKind::Json | ArgKind::Value => {
                if i < args.len() && !args[i].starts_with("--") {
                    i += 1;
                }
            }
        }
    }
    (keep, ignored)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn sglang_only_flags_are_dropped_with_their_values() {
        let own = v(&["--port", "--enable-memory-saver"]);
        let (keep, ignored) = split_foreign(
            &v(&[
                "--port",
                "1",
                "--chunked-prefill-size",
                "512",
                "--enable-memory-saver",
                "--trust-remote-code",
                "--attention-backend=fa3",
                "--not-a-flag",
                "x",
            ]),
            &own,
        );
        assert_eq!(
            keep,
            v(&["--port", "1", "--enable-memory-saver", "--not-a-flag", "x"])
        );
        assert_eq!(
            ignored,
            v(&[
                "--chunked-prefill-size",
                "--trust-remote-code",
                "--attention-backend"
            ])
        );
    }
}
