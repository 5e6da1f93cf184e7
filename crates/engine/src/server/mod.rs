//! The HTTP server: SGLang's endpoints over axum.
//!
//! - [`generate`]: `/generate` (single, batch, stream, logprobs, PD).
//! - [`openai`]: `/v1/completions`, `/v1/chat/completions`.
//! - [`control`]: pause / continue / abort / flush / memory / weight version.
//! - [`weights_api`]: weight-update groups and `/update_weights_from_disk`.
//! - [`info`]: health, server and model info, loads, metrics.
//! - [`vllm`], [`vllm_transfer`]: vLLM's RL routes over the same operations.
//! - [`staging`]: Troupe's commit and abort of a staged weight update (both dialects).
//! - [`tokens`]: vLLM's `/tokenize`, `/detokenize`; [`inference`]: its token-in/token-out
//!   `/inference/v1/generate`.
//! - [`parse`], [`error`]: request parsing and SGLang-style errors; [`keep_alive`]: small
//!   bodies read before routing, so every answer leaves the connection reusable.

mod chat;
pub mod control;
pub mod error;
pub mod generate;
pub mod inference;
pub mod info;
pub mod keep_alive;
pub mod openai;
pub mod parse;
pub mod staging;
pub mod tokens;
pub mod vllm;
pub mod vllm_transfer;
pub mod weights_api;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use troupe_weights::tcp::WeightReceiver;
use troupe_wire::Endpoint;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::ServeEndpoint;

use crate::config::{DisaggMode, EngineArgs};
use crate::core::EngineCore;
use crate::model::ModelConfig;
use crate::pd::RoomStore;
use error::ApiError;

/// Shared state of all handlers.
#[derive(Debug)]
pub struct AppState {
    /// Flags as given.
    pub args: EngineArgs,
    /// Model architecture.
    pub config: ModelConfig,
    /// Serving role.
    pub mode: DisaggMode,
    /// The scheduler.
    pub core: EngineCore,
    /// Request counter for server-chosen seeds.
    pub counter: AtomicU64,
    /// Decode: how long to wait for KV.
    pub kv_timeout: Duration,
    /// Weight-update join / bucket timeout.
    pub weights_timeout: Duration,
    /// Prefill: the bound bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// Prefill: rooms awaiting pickup.
    pub rooms: Option<Arc<RoomStore>>,
    /// Joined weight-update groups by name.
    pub groups: tokio::sync::Mutex<HashMap<String, WeightReceiver>>,
    /// The tensors this engine holds as bases of delta weight updates, kept across groups (a
    /// group is rebuilt when the fleet changes; this engine's weights stay).
    pub weight_bases: troupe_weights::delta::SharedReceiverBases,
    /// The HTTP address.
    pub addr: SocketAddr,
    /// What vLLM's routes keep between calls (their pause's refusal of new requests, the
    /// weight-transfer session).
    pub vllm: vllm::VllmState,
}

/// Whether `given` is `want` (compared in constant time).
fn is_key(given: Option<&str>, want: &str) -> bool {
    given.is_some_and(|g| troupe_wire::auth::same(g.as_bytes(), want.as_bytes()))
}

/// The engine's one middleware (one layer, so one boxed service clone per request): reads a
/// small body first ([`keep_alive::read_ahead`], at most 64 KiB, so a refused request still
/// leaves its connection reusable; a larger body is never read before the key is checked),
/// then checks the key ([`denied`]).
async fn admit(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let req = match keep_alive::read_ahead(req).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    if let Some(answer) = denied(&state, &req) {
        return answer;
    }
    next.run(req).await
}

/// The 401 for a request without the key its endpoint needs: control endpoints the admin key
/// (or the API key when no admin key is set), the rest the API key (or the admin key), health
/// and metrics none.
fn denied(state: &AppState, req: &Request) -> Option<Response> {
    let path = req.uri().path();
    let open =
        path.starts_with(ep::Health::PATH) || path == ep::Metrics::PATH || path == ep::Ready::PATH;
    let given = troupe_wire::auth::bearer(req.headers());
    if troupe_wire::routes::engine_admin(path) {
        let want = state
            .args
            .admin_api_key
            .as_deref()
            .or(state.args.api_key.as_deref());
        if let Some(key) = want
            && !is_key(given, key)
        {
            return Some(
                ApiError::unauthorized(format!(
                    "{path} is a control-plane endpoint: send Authorization: Bearer <admin api key>"
                ))
                .control()
                .into_response(),
            );
        }
    } else if !open
        && let Some(key) = state.args.api_key.as_deref()
        && !is_key(given, key)
        && !state
            .args
            .admin_api_key
            .as_deref()
            .is_some_and(|a| is_key(given, a))
    {
        return Some(
            ApiError::unauthorized(
                "missing or wrong API key: send Authorization: Bearer <api key>",
            )
            .into_response(),
        );
    }
    None
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no endpoint {} {}", req.method(), req.uri().path()))
}

/// The largest request body the engine reads: the gateway's default client-facing limit
/// (`troupe_serving::client::DEFAULT_MAX_BODY_BYTES`, 32 MiB) plus room for what it adds.
pub const MAX_BODY_BYTES: usize = 33 << 20;

/// Builds the router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .engine_endpoint(ep::Health, info::health)
        .engine_endpoint(ep::HealthGenerate, info::health_generate)
        .engine_endpoint(ep::Ready, info::ready)
        .engine_endpoint(ep::ServerInfo, info::server_info)
        .engine_endpoint(ep::GetServerInfo, info::server_info)
        .engine_endpoint(ep::ModelInfo, info::model_info)
        .engine_endpoint(ep::GetModelInfo, info::model_info)
        .engine_endpoint(ep::Models, info::models)
        .engine_endpoint(ep::GetLoad, info::get_load)
        .engine_endpoint(ep::Loads, info::loads)
        .engine_endpoint(ep::Metrics, info::metrics)
        .engine_endpoint(ep::GetWeightVersion, info::weight_version)
        .engine_endpoint(ep::Generate, generate::generate)
        .engine_endpoint(ep::Completions, openai::completions)
        .engine_endpoint(ep::ChatCompletions, openai::chat_completions)
        .engine_endpoint(ep::AbortRequest, control::abort_request)
        .engine_endpoint(ep::FlushCache, control::flush_cache)
        .engine_endpoint(ep::PauseGeneration, control::pause_generation)
        .engine_endpoint(ep::ContinueGeneration, control::continue_generation)
        .engine_endpoint(ep::ReleaseMemoryOccupation, control::release_memory)
        .engine_endpoint(ep::ResumeMemoryOccupation, control::resume_memory)
        .engine_endpoint(ep::UpdateWeightVersion, control::update_weight_version)
        .engine_endpoint(ep::InitWeightsUpdateGroup, weights_api::init_group)
        .engine_endpoint(
            ep::UpdateWeightsFromDistributed,
            weights_api::update_from_distributed,
        )
        .engine_endpoint(ep::DestroyWeightsUpdateGroup, weights_api::destroy_group)
        .engine_endpoint(ep::UpdateWeightsFromDisk, weights_api::update_from_disk)
        .engine_endpoint(ep::Tokenize, tokens::tokenize)
        .engine_endpoint(ep::Detokenize, tokens::detokenize)
        .engine_endpoint(ep::InferenceGenerate, inference::generate)
        .merge(vllm::routes())
        .merge(staging::routes())
        .fallback(not_found)
        // As large as a gateway passes on (its client-facing limit), so a prompt too long for
        // the context is answered 400 naming the context, not 413 from axum's 2 MiB default.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), admit))
        .with_state(state)
}
