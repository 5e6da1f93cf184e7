//! Every endpoint of the engine protocol, one type each, and [`ROUTES`], the table built from
//! them. Control routes first (SGLang's, vLLM's with the SkyRL RFC's aliases, Troupe's), then
//! the inference routes and the probes.
//!
//! A handler is registered at `E::PATH` with `E::ROUTE.methods`; a client sends `E::Request`
//! and reads `E::Response`. Adding a route is one line here; the key checks, the gateway's
//! forwarder and the routes test pick it up from [`ROUTES`].

use super::{Carrier, Endpoint, EngineAuth, Kind, Route, Side};
use crate::EngineDialect::{self, Sglang, Vllm};
use crate::answers::{self, Ack, ModelList};
use crate::{sglang, staging, vllm};
use EngineAuth::{Admin, Normal};
use serde_json::Value;

/// `POST` only.
pub const POST: &[&str] = &["POST"];
/// `GET` only.
pub const GET: &[&str] = &["GET"];
/// `GET` and `POST` (SGLang's `/flush_cache`).
pub const GET_POST: &[&str] = &["GET", "POST"];
/// `GET` and `DELETE` (one of the gateway's workers).
pub const GET_DELETE: &[&str] = &["GET", "DELETE"];
/// `PUT` (what SGLang's engine takes on `/generate` besides `POST`).
pub const PUT: &[&str] = &["PUT"];

/// The body of a `POST` that takes no fields: sent as `{}`, any object accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Empty {}

const fn route(
    path: &'static str,
    methods: &'static [&'static str],
    dialect: Option<EngineDialect>,
    mutates: bool,
    engine_auth: EngineAuth,
    side: Side,
    kind: Kind,
) -> Route {
    Route {
        path,
        methods,
        dialect,
        mutates,
        engine_auth,
        side,
        kind,
        engine_also: &[],
    }
}

/// Declares the endpoint types and [`ROUTES`] from one list, so the table cannot omit one.
macro_rules! endpoints {
    ($(
        $(#[$doc:meta])*
        $name:ident = $path:expr, $methods:expr, $dialect:expr, $mutates:expr, $auth:expr,
            $side:ident, $kind:ident, $carrier:ident: $req:ty => $resp:ty
            $(, engine also $also:expr)?;
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
            pub struct $name;

            impl Endpoint for $name {
                const ROUTE: Route = route(
                    $path, $methods, $dialect, $mutates, $auth, Side::$side, Kind::$kind,
                )$(.with_engine_also($also))?;
                const CARRIER: Carrier = Carrier::$carrier;
                type Request = $req;
                type Response = $resp;
            }
        )*

        /// Every route of the engine protocol, built from the endpoint types above.
        pub const ROUTES: &[Route] = &[$(<$name as Endpoint>::ROUTE),*];
    };
}

endpoints! {
    // SGLang: control.
    /// SGLang `POST /pause_generation {mode}`.
    PauseGeneration = "/pause_generation", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::PauseGeneration => Ack;
    /// SGLang `POST /continue_generation` (the reference engine honours `If-Match: <version>`).
    ContinueGeneration = "/continue_generation", POST, Some(Sglang), true, Admin, Both, Control, Json: Empty => Ack;
    /// SGLang `/flush_cache`: drop the prefix cache (only when idle).
    FlushCache = "/flush_cache", GET_POST, Some(Sglang), true, Admin, Both, Control, Json: Empty => Ack;
    /// SGLang `POST /release_memory_occupation {tags}`.
    ReleaseMemoryOccupation = "/release_memory_occupation", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::MemoryTags => Ack;
    /// SGLang `POST /resume_memory_occupation {tags}`.
    ResumeMemoryOccupation = "/resume_memory_occupation", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::MemoryTags => Ack;
    /// SGLang `POST /abort_request {rid | abort_all}`.
    AbortRequest = "/abort_request", POST, Some(Sglang), true, Normal, Both, Control, Json: sglang::AbortRequest => Ack;
    /// SGLang `POST /init_weights_update_group`: join a trainer's broadcast group.
    InitWeightsUpdateGroup = "/init_weights_update_group", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::InitWeightsUpdateGroup => Ack;
    /// SGLang `POST /update_weights_from_distributed`: one bucket from the group's broadcast.
    UpdateWeightsFromDistributed = "/update_weights_from_distributed", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::UpdateWeightsFromDistributed => Ack;
    /// SGLang `POST /destroy_weights_update_group`.
    DestroyWeightsUpdateGroup = "/destroy_weights_update_group", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::DestroyWeightsUpdateGroup => Ack;
    /// SGLang `POST /update_weights_from_disk {model_path, ...}`.
    UpdateWeightsFromDisk = "/update_weights_from_disk", POST, Some(Sglang), true, Admin, Both, Control, Json: sglang::UpdateWeightsFromDisk => Ack;
    /// `POST /update_weight_version {new_version, abort_all_requests}` (SGLang's and vLLM's).
    UpdateWeightVersion = "/update_weight_version", POST, Some(Sglang), true, Admin, Both, Control, Json: vllm::UpdateWeightVersion => Ack;
    // SGLang: reads.
    /// SGLang `GET /get_weight_version`.
    GetWeightVersion = "/get_weight_version", GET, Some(Sglang), false, Normal, Both, Control, None: () => sglang::GetWeightVersion;
    /// SGLang `GET /server_info`.
    ServerInfo = "/server_info", GET, Some(Sglang), false, Normal, Both, Control, None: () => answers::ServerInfo;
    /// SGLang's older name of `/server_info`.
    GetServerInfo = "/get_server_info", GET, Some(Sglang), false, Normal, Both, Control, None: () => answers::ServerInfo;
    /// SGLang `GET /model_info`.
    ModelInfo = "/model_info", GET, Some(Sglang), false, Normal, Both, Control, None: () => answers::ModelInfo;
    /// SGLang's older name of `/model_info`.
    GetModelInfo = "/get_model_info", GET, Some(Sglang), false, Normal, Both, Control, None: () => answers::ModelInfo;
    /// SGLang `GET /health_generate`: one generated token proves the engine serves.
    HealthGenerate = "/health_generate", GET, Some(Sglang), false, Normal, Both, Control, None: () => Ack;
    // vLLM (SkyRL's RemoteInferenceClient): control.
    /// vLLM `POST /pause?mode=`.
    Pause = "/pause", POST, Some(Vllm), true, Admin, Both, Control, Query: vllm::Pause => Ack;
    /// vLLM `POST /resume`.
    Resume = "/resume", POST, Some(Vllm), true, Admin, Both, Control, Json: Empty => Ack;
    /// vLLM `POST /sleep?level=&mode=&tags=`.
    Sleep = "/sleep", POST, Some(Vllm), true, Admin, Both, Control, Query: vllm::Sleep => Ack;
    /// vLLM `POST /wake_up?tags=`.
    WakeUp = "/wake_up", POST, Some(Vllm), true, Admin, Both, Control, Query: vllm::WakeUp => Ack;
    /// vLLM `POST /reset_prefix_cache`.
    ResetPrefixCache = "/reset_prefix_cache", POST, Some(Vllm), true, Admin, Both, Control, Json: vllm::ResetPrefixCache => Ack;
    /// vLLM `POST /init_weight_transfer_engine {init_info}`.
    InitWeightTransferEngine = "/init_weight_transfer_engine", POST, Some(Vllm), true, Admin, Both, Control, Json: vllm::InitWeightTransferEngine => Ack;
    /// vLLM `POST /shutdown_weight_transfer_engine` (one server's; the fleet has none).
    ShutdownWeightTransferEngine = "/shutdown_weight_transfer_engine", POST, Some(Vllm), true, Admin, Engine, Control, Json: Empty => Ack;
    /// vLLM `POST /start_weight_update`.
    StartWeightUpdate = "/start_weight_update", POST, Some(Vllm), true, Admin, Both, Control, Json: Empty => Ack;
    /// vLLM `POST /update_weights {update_info}`.
    UpdateWeights = "/update_weights", POST, Some(Vllm), true, Admin, Both, Control, Json: vllm::UpdateWeights => Ack;
    /// vLLM `POST /finish_weight_update`.
    FinishWeightUpdate = "/finish_weight_update", POST, Some(Vllm), true, Admin, Both, Control, Json: vllm::FinishWeightUpdate => Ack;
    /// vLLM `POST /collective_rpc {method, args, kwargs}`.
    CollectiveRpc = "/collective_rpc", POST, Some(Vllm), true, Admin, Both, Control, Json: vllm::CollectiveRpc => Ack;
    /// vLLM `POST /abort_requests {request_ids}`.
    AbortRequests = "/abort_requests", POST, Some(Vllm), true, Normal, Both, Control, Json: vllm::AbortRequests => Ack;
    // Troupe: staged weight updates, both dialects (`crate::staging`).
    /// `POST /commit_weight_update`: swap every staged bucket in.
    CommitWeightUpdate = staging::COMMIT_PATH, POST, None, true, Admin, Engine, Control, Json: staging::CommitWeightUpdate => Ack;
    /// `POST /abort_weight_update`: drop what is staged.
    AbortWeightUpdate = staging::ABORT_PATH, POST, None, true, Admin, Engine, Control, Json: staging::AbortWeightUpdate => staging::Discarded;
    // vLLM: reads.
    /// vLLM `GET /is_paused`.
    IsPaused = "/is_paused", GET, Some(Vllm), false, Normal, Both, Control, None: () => vllm::IsPaused;
    /// vLLM `GET /is_sleeping`.
    IsSleeping = "/is_sleeping", GET, Some(Vllm), false, Normal, Both, Control, None: () => Value;
    /// vLLM `GET /get_world_size`.
    GetWorldSize = "/get_world_size", GET, Some(Vllm), false, Normal, Both, Control, None: () => vllm::WorldSize;
    /// vLLM `GET /weight_info`.
    WeightInfo = "/weight_info", GET, Some(Vllm), false, Normal, Both, Control, None: () => sglang::GetWeightVersion;
    // The SkyRL RFC's names for vLLM's routes: the fleet's aliases.
    /// The SkyRL RFC's `/wakeup` (vLLM's `/wake_up`).
    Wakeup = "/wakeup", POST, Some(Vllm), true, Admin, Gateway, Control, Query: vllm::WakeUp => Ack;
    /// The SkyRL RFC's `/init_weight_update_communicator` (vLLM's `/init_weight_transfer_engine`).
    InitWeightUpdateCommunicator = "/init_weight_update_communicator", POST, Some(Vllm), true, Admin, Gateway, Control, Json: vllm::InitWeightTransferEngine => Ack;
    // Troupe: fleet-only control.
    /// A whole model pushed as a safetensors body (the plane is rank 0).
    UpdateWeightsFromTensor = "/update_weights_from_tensor", POST, None, true, Admin, Gateway, Control, None: () => Value;
    /// Servers join and leave a running deployment (`troupe_serving::scale`).
    Scale = "/scale", POST, None, true, Admin, Gateway, Control, Json: Value => Value;
    // Inference, both dialects' and OpenAI's.
    /// SGLang `/generate` (text or token ids in, `meta_info` out; SGLang's engine takes PUT
    /// too, its router and the gateway do not).
    Generate = "/generate", POST, Some(Sglang), false, Normal, Both, Inference, Json: Value => Value, engine also PUT;
    /// vLLM's token-in/token-out `POST /inference/v1/generate`.
    InferenceGenerate = "/inference/v1/generate", POST, Some(Vllm), false, Normal, Both, Inference, Json: Value => Value;
    /// OpenAI `POST /v1/completions`.
    Completions = "/v1/completions", POST, None, false, Normal, Both, Inference, Json: Value => Value;
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions = "/v1/chat/completions", POST, None, false, Normal, Both, Inference, Json: Value => Value;
    /// OpenAI `GET /v1/models`.
    Models = "/v1/models", GET, None, false, Normal, Both, Inference, None: () => ModelList;
    /// vLLM `POST /tokenize`.
    Tokenize = "/tokenize", POST, Some(Vllm), false, Normal, Both, Inference, Json: Value => Value;
    /// vLLM `POST /detokenize`.
    Detokenize = "/detokenize", POST, Some(Vllm), false, Normal, Both, Inference, Json: Value => Value;
    /// Troupe's gateway: end a sticky session (`X-Session-ID`).
    FinishSession = "/finish_session", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Troupe's gateway: forget every sticky session (admin-keyed by the gateway).
    ClearSessions = "/clear_sessions", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    // The gateway's agent layer (`troupe_serving::gateway::agent`).
    /// AReaL's agents' chat: OpenAI's route without `/v1` (their `base_url` is the gateway).
    BareChatCompletions = "/chat/completions", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// OpenAI `POST /v1/responses`.
    Responses = "/v1/responses", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Anthropic `POST /v1/messages`.
    Messages = "/v1/messages", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Anthropic `POST /v1/messages/count_tokens`.
    CountTokens = "/v1/messages/count_tokens", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Open a recorded session (admin-keyed by the gateway).
    OpenSession = "/sessions", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// A recorded session's reward.
    SessionReward = "/sessions/{id}/reward", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Finish a recorded session.
    SessionFinish = "/sessions/{id}/finish", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Grant a session more room (admin-keyed by the gateway).
    GrantCapacity = "/grant_capacity", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// AReaL's `POST /rl/start_session` (admin-keyed by the gateway).
    RlStartSession = "/rl/start_session", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// AReaL's `POST /rl/end_session`.
    RlEndSession = "/rl/end_session", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// AReaL's `POST /rl/set_reward`.
    RlSetReward = "/rl/set_reward", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    /// Export recorded trajectories (admin-keyed by the gateway).
    ExportTrajectories = "/export_trajectories", POST, None, false, Normal, Gateway, Inference, Json: Value => Value;
    // The gateway's management.
    /// The gateway's workers: `GET` lists them, `POST` adds one.
    Workers = "/workers", GET_POST, None, true, Admin, Gateway, Admin, Json: Value => Value;
    /// One of the gateway's workers: `GET` describes it, `DELETE` removes it.
    Worker = "/workers/{id}", GET_DELETE, None, true, Admin, Gateway, Admin, None: () => Value;
    // Probes.
    /// `GET /health`: 200 while the server lives.
    Health = "/health", GET, None, false, Normal, Both, Probe, None: () => Ack;
    /// `GET /metrics`: Prometheus text.
    Metrics = "/metrics", GET, None, false, Normal, Both, Probe, None: () => Value;
    /// The gateway's `GET /liveness` (its `/health`).
    Liveness = "/liveness", GET, None, false, Normal, Gateway, Probe, None: () => Value;
    /// The gateway's `GET /readiness`: 200 once a worker is healthy.
    Readiness = "/readiness", GET, None, false, Normal, Gateway, Probe, None: () => Value;
    /// The engine's `GET /ready`.
    Ready = "/ready", GET, None, false, Normal, Engine, Probe, None: () => Value;
    /// SGLang `GET /get_load`.
    GetLoad = "/get_load", GET, Some(Sglang), false, Normal, Engine, Probe, None: () => Value;
    /// SGLang `GET /v1/loads`.
    Loads = "/v1/loads", GET, Some(Sglang), false, Normal, Engine, Probe, None: () => Value;
    /// vLLM `GET /version` (what registration falls back to when `/server_info` is slow).
    Version = "/version", GET, Some(Vllm), false, Normal, Foreign, Probe, None: () => answers::VllmVersion;
}
