//! The engine protocol's control routes, once: path, methods, dialect, who may call them and
//! whether they change anything, and which side serves them.
//!
//! The reference engine's admin list, its vLLM route list and the gateway's fleet control
//! endpoints are all read from [`ROUTES`], so they cannot drift apart (they had: the engine
//! served `/shutdown_weight_transfer_engine` and the gateway did not, the gateway took `/wakeup`
//! and the engine did not). A test in the workspace (`tests/serving/routes.rs`) checks every
//! route here against both servers.
//!
//! Auth levels follow the engines' own. SGLang 0.5.23 marks its mutating control routes
//! `AuthLevel.ADMIN_OPTIONAL` (the admin key when one is set) and leaves its read-only info
//! routes at the normal level; vLLM's development routes are its control routes. So: a route
//! that [`Route::mutates`] needs the admin key at the gateway; a read-only one is open there
//! unless the gateway is configured to key reads too.

/// Who serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The reference engine (one engine) and the gateway (the whole fleet).
    Both,
    /// Only an engine: it makes no sense fleet-wide.
    Engine,
    /// Only the gateway: a fleet-level name or an operation engines do not have.
    Gateway,
}

/// What an engine asks of a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineAuth {
    /// The engine's admin key (its API key when it has no admin key).
    Admin,
    /// Its API key, like an inference request (when one is set).
    Normal,
}

/// One control route of the engine protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The path.
    pub path: &'static str,
    /// The methods it takes (`GET`, `POST`).
    pub methods: &'static [&'static str],
    /// Whose protocol it belongs to (`None`: Troupe's own).
    pub dialect: Option<crate::EngineDialect>,
    /// Whether calling it changes anything (pause, load, free, abort): such a route needs the
    /// admin key at the gateway.
    pub mutates: bool,
    /// What the reference engine asks of a caller.
    pub engine_auth: EngineAuth,
    /// Who serves it.
    pub side: Side,
}

use crate::EngineDialect::{Sglang, Vllm};
use EngineAuth::{Admin, Normal};

const POST: &[&str] = &["POST"];
const GET: &[&str] = &["GET"];
const GET_POST: &[&str] = &["GET", "POST"];

const fn route(
    path: &'static str,
    methods: &'static [&'static str],
    dialect: Option<crate::EngineDialect>,
    mutates: bool,
    engine_auth: EngineAuth,
    side: Side,
) -> Route {
    Route {
        path,
        methods,
        dialect,
        mutates,
        engine_auth,
        side,
    }
}

/// Every control route, SGLang's, vLLM's (with the SkyRL RFC's aliases) and Troupe's.
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    // SGLang: control.
    route("/pause_generation", POST, Some(Sglang), true, Admin, Side::Both),
    route("/continue_generation", POST, Some(Sglang), true, Admin, Side::Both),
    route("/flush_cache", GET_POST, Some(Sglang), true, Admin, Side::Both),
    route("/release_memory_occupation", POST, Some(Sglang), true, Admin, Side::Both),
    route("/resume_memory_occupation", POST, Some(Sglang), true, Admin, Side::Both),
    route("/abort_request", POST, Some(Sglang), true, Normal, Side::Both),
    route("/init_weights_update_group", POST, Some(Sglang), true, Admin, Side::Both),
    route("/update_weights_from_distributed", POST, Some(Sglang), true, Admin, Side::Both),
    route("/destroy_weights_update_group", POST, Some(Sglang), true, Admin, Side::Both),
    route("/update_weights_from_disk", POST, Some(Sglang), true, Admin, Side::Both),
    route("/update_weight_version", POST, Some(Sglang), true, Admin, Side::Both),
    // SGLang: reads.
    route("/get_weight_version", GET, Some(Sglang), false, Normal, Side::Both),
    route("/server_info", GET, Some(Sglang), false, Normal, Side::Both),
    route("/get_server_info", GET, Some(Sglang), false, Normal, Side::Both),
    route("/model_info", GET, Some(Sglang), false, Normal, Side::Both),
    route("/get_model_info", GET, Some(Sglang), false, Normal, Side::Both),
    route("/health_generate", GET, Some(Sglang), false, Normal, Side::Both),
    // vLLM (SkyRL's RemoteInferenceClient): control.
    route("/pause", POST, Some(Vllm), true, Admin, Side::Both),
    route("/resume", POST, Some(Vllm), true, Admin, Side::Both),
    route("/sleep", POST, Some(Vllm), true, Admin, Side::Both),
    route("/wake_up", POST, Some(Vllm), true, Admin, Side::Both),
    route("/reset_prefix_cache", POST, Some(Vllm), true, Admin, Side::Both),
    route("/init_weight_transfer_engine", POST, Some(Vllm), true, Admin, Side::Both),
    route("/shutdown_weight_transfer_engine", POST, Some(Vllm), true, Admin, Side::Engine),
    route("/start_weight_update", POST, Some(Vllm), true, Admin, Side::Both),
    route("/update_weights", POST, Some(Vllm), true, Admin, Side::Both),
    route("/finish_weight_update", POST, Some(Vllm), true, Admin, Side::Both),
    route("/collective_rpc", POST, Some(Vllm), true, Admin, Side::Both),
    route("/abort_requests", POST, Some(Vllm), true, Normal, Side::Both),
    // Troupe: staged weight updates, both dialects (`crate::staging`).
    route(crate::staging::COMMIT_PATH, POST, None, true, Admin, Side::Engine),
    route(crate::staging::ABORT_PATH, POST, None, true, Admin, Side::Engine),
    // vLLM: reads.
    route("/is_paused", GET, Some(Vllm), false, Normal, Side::Both),
    route("/is_sleeping", GET, Some(Vllm), false, Normal, Side::Both),
    route("/get_world_size", GET, Some(Vllm), false, Normal, Side::Both),
    route("/weight_info", GET, Some(Vllm), false, Normal, Side::Both),
    // The SkyRL RFC's names for vLLM's routes: the fleet's aliases.
    route("/wakeup", POST, Some(Vllm), true, Admin, Side::Gateway),
    route("/init_weight_update_communicator", POST, Some(Vllm), true, Admin, Side::Gateway),
    // Troupe: a whole model pushed as a safetensors body (the plane is rank 0).
    route("/update_weights_from_tensor", POST, None, true, Admin, Side::Gateway),
    // Troupe: servers join and leave a running deployment (`troupe_serving::scale`).
    route("/scale", POST, None, true, Admin, Side::Gateway),
];

/// The route at `path`, if it is a control route. One hash lookup: every request to the
/// gateway and the engine asks (their key checks).
pub fn find(path: &str) -> Option<&'static Route> {
    static BY_PATH: std::sync::OnceLock<std::collections::HashMap<&'static str, &'static Route>> =
        std::sync::OnceLock::new();
    BY_PATH
        .get_or_init(|| ROUTES.iter().map(|r| (r.path, r)).collect())
        .get(path)
        .copied()
}

/// Paths the gateway serves as fleet control endpoints.
pub fn gateway_paths() -> impl Iterator<Item = &'static str> {
    ROUTES
        .iter()
        .filter(|r| r.side != Side::Engine)
        .map(|r| r.path)
}

/// Whether the reference engine asks for its admin key on `path`.
pub fn engine_admin(path: &str) -> bool {
    find(path).is_some_and(|r| r.side != Side::Gateway && r.engine_auth == Admin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_unique_and_reads_are_gets() {
        let mut seen = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(seen.insert(r.path), "{} twice", r.path);
            assert!(r.path.starts_with('/'));
            if !r.mutates {
                assert_eq!(r.methods, GET, "{}: reads are GETs", r.path);
                assert_eq!(r.engine_auth, Normal, "{}", r.path);
            }
        }
        assert!(engine_admin("/pause_generation"));
        assert!(!engine_admin("/server_info"));
        assert!(!engine_admin("/wakeup"), "gateway-only");
        assert!(gateway_paths().any(|p| p == "/wakeup"));
        assert!(!gateway_paths().any(|p| p == "/shutdown_weight_transfer_engine"));
    }
}
