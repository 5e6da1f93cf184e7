//! Whether a vLLM server can take weights over Troupe's transport, and the flag that makes it.
//!
//! vLLM's four-phase weight update runs through a pluggable weight-transfer engine, selected by
//! `--weight-transfer-config '{"backend": ...}'`; the engines vLLM ships need CUDA. Troupe's
//! Python package registers one more, `troupe` (`python/troupe/vllm_transfer.py`, through vLLM's
//! `vllm.general_plugins` entry point), which joins Troupe's TCP broadcast. A server is started
//! with it when its interpreter has the package (asked once per interpreter: a Python start
//! that reads the installed entry points, without importing vLLM), unless the user chose a
//! backend: naming a backend vLLM does not have would stop the server at start, so without the
//! package the flag is left out and a warning says what the four-phase routes then lack.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::spec::{Backend, LaunchSpec};

/// vLLM's flag (vLLM 0.32: `vllm/engine/arg_utils.py`, `WeightTransferConfig`).
pub const FLAG: &str = "--weight-transfer-config";

/// The value that selects Troupe's engine.
pub const TROUPE_BACKEND: &str = r#"{"backend": "troupe"}"#;

/// How long asking an interpreter may take (a cold start of Python on a loaded machine).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Prints 1 when an entry point named `troupe` is in vLLM's plugin group.
const PROBE: &str = "from importlib.metadata import entry_points as e\n\
print(int(any(p.name == 'troupe' for p in e(group='vllm.general_plugins'))))";

/// Whether the spec is a vLLM server whose weight-transfer backend is Troupe's to choose.
pub fn wants_backend(spec: &LaunchSpec) -> bool {
    spec.backend == Backend::Vllm
        && !spec
            .extra_args
            .iter()
            .any(|a| a == FLAG || a.starts_with(&format!("{FLAG}=")))
}

/// Whether `python` has Troupe's vLLM plugin; the answer is kept for the process's life.
/// Blocks for a Python start the first time per interpreter.
pub fn has_plugin(python: &str) -> bool {
    static SEEN: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);
    if let Ok(g) = SEEN.lock()
        && let Some(&known) = g.as_ref().and_then(|m| m.get(python))
    {
        return known;
    }
    let found = super::probe::run(python, &["-c", PROBE], None, PROBE_TIMEOUT)
        .is_ok_and(|out| out.trim() == "1");
    if let Ok(mut g) = SEEN.lock() {
        g.get_or_insert_with(HashMap::new)
            .insert(python.to_string(), found);
    }
    found
}

/// Adds `--weight-transfer-config` selecting Troupe's engine to a vLLM server whose Python has
/// the plugin and whose user chose no backend; warns when the plugin is missing. Blocks the
/// first time per interpreter (see [`has_plugin`]); `troupe plan` runs it as launching does, so
/// the plan shows the flag.
pub fn choose_backend(spec: &mut LaunchSpec) {
    if !wants_backend(spec) {
        return;
    }
    if has_plugin(&spec.python) {
        spec.extra_args
            .extend([FLAG.to_string(), TROUPE_BACKEND.to_string()]);
    } else {
        tracing::warn!(
            python = %spec.python,
            "this vLLM's Python does not have Troupe's package, so the server has no weight-transfer \
             engine that works without CUDA: weight updates from a trainer (the controller's sync, \
             /update_weights_from_tensor, vLLM's four-phase routes) will fail on it. Install it \
             there (`{} -m pip install ./python`) or set vllm.weight_transfer_config",
            spec.python
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::WorkerType;

    fn spec(backend: Backend, extra: &[&str]) -> LaunchSpec {
        LaunchSpec {
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            ..crate::spec::test_spec(backend, WorkerType::Regular)
        }
    }

    #[test]
    fn only_vllm_servers_without_a_chosen_backend_get_one() {
        assert!(wants_backend(&spec(Backend::Vllm, &[])));
        assert!(!wants_backend(&spec(Backend::Sglang, &[])));
        assert!(!wants_backend(&spec(Backend::Troupe, &[])));
        assert!(!wants_backend(&spec(
            Backend::Vllm,
            &[FLAG, r#"{"backend":"nccl"}"#]
        )));
        assert!(!wants_backend(&spec(
            Backend::Vllm,
            &[r#"--weight-transfer-config={"backend":"ipc"}"#]
        )));
    }

    #[test]
    fn an_interpreter_that_cannot_run_has_no_plugin() {
        assert!(!has_plugin("/nonexistent/troupe-test/python"));
    }
}
