//! Read-only endpoints: health, readiness, server and model info, loads, metrics.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::AppState;
use super::error::ApiError;
use crate::core::{Command, FinishReason, SeqEvent, SeqKind, SeqRequest};
use crate::sampling::SamplingParams;

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `GET /health`: 200 while the scheduler thread is alive.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.core.status().alive {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("engine scheduler stopped").into_response()
    }
}

/// `GET /health_generate`: runs a one-token generation through the model (always locally,
/// whatever the PD role). Paused or memory-released servers answer 200 without generating,
/// since they are idle on purpose.
pub async fn health_generate(State(state): State<Arc<AppState>>) -> Response {
    let st = state.core.status();
    if st.paused.is_some() || st.weights_released || st.kv_cache_released {
        return StatusCode::OK.into_response();
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let req = SeqRequest {
        rid: format!("health-{}", uuid::Uuid::new_v4().simple()),
        input_ids: vec![u32::from(b'h')],
        params: SamplingParams {
            max_new_tokens: 1,
            temperature: 0.0,
            ..Default::default()
        },
        seed: 0,
        return_logprob: false,
        logprob_start: 0,
        kind: SeqKind::Regular,
        events: tx,
    };
    if let Err(e) = state.core.send(Command::Submit(Box::new(req))) {
        return ApiError::unavailable(e.to_string()).into_response();
    }
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(ev) = rx.recv().await {
            if let SeqEvent::Finished { reason, .. } = ev {
                return !matches!(reason, FinishReason::Abort(_));
            }
        }
        false
    })
    .await;
    match waited {
        Ok(true) => StatusCode::OK.into_response(),
        _ => ApiError::unavailable("health generation did not complete").into_response(),
    }
}

/// `GET /ready`.
pub async fn ready() -> Response {
    axum::Json(json!({"status": "ready"})).into_response()
}

/// `GET /server_info` (and `/get_server_info`): server arguments plus internal state, like
/// SGLang's (the router reads `tp_size`, `dp_size`, `disaggregation_mode`, `model_path`).
pub async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    let st = state.core.status();
    axum::Json(json!({
        "model_path": a.model_path.as_ref().map(|p| p.display().to_string()),
        "tokenizer_path": Value::Null,
        "served_model_name": a.served_name(),
        "host": a.host,
        "port": state.addr.port(),
        "tp_size": a.tp_size,
        "dp_size": a.dp_size,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": state.mode.as_str(),
        "disaggregation_bootstrap_port": state.bootstrap_port.unwrap_or(a.disaggregation_bootstrap_port),
        "disaggregation_transfer_backend": a.disaggregation_transfer_backend,
        "max_running_requests": a.max_running_requests,
        "random_seed": a.random_seed,
        "enable_memory_saver": a.enable_memory_saver,
        "context_length": state.config.max_position_embeddings,
        "max_total_num_tokens": a.kv_pool_tokens(&state.config),
        "max_total_tokens": a.max_total_tokens,
        "disable_radix_cache": a.disable_radix_cache,
        "sim_prefill_tokens_per_s": a.sim_prefill_tokens_per_s,
        "sim_decode_step_ms": a.sim_decode_step_ms,
        "model_config": state.config,
        "weight_version": st.weight_version,
        "internal_states": [{
            "last_gen_throughput": st.last_gen_throughput,
            "weight_version": st.weight_version,
            "paused": st.paused,
            "weights_released": st.weights_released,
            "kv_cache_released": st.kv_cache_released,
            "prefix_cache_tokens": st.prefix_cache_tokens,
            "prompt_tokens_total": st.prompt_tokens_total,
            "cached_tokens_total": st.cached_tokens_total,
            "prefill_computed_tokens_total": st.prefill_computed_tokens_total,
            "kv_received_tokens_total": st.kv_received_tokens_total,
            "kv_local_tokens_total": st.kv_local_tokens_total,
        }],
        "version": concat!("troupe-engine ", env!("CARGO_PKG_VERSION")),
        // `/continue_generation` honours `If-Match: "<weight version>"`: a gateway that only
        // has this server's URL learns here that it may check and resume in one call.
        "resume_if_match": true,
        // Buckets sent with `stage` wait for `/commit_weight_update` (`troupe_wire::staging`).
        (troupe_wire::staging::CAPABILITY): true,
        "weights_staged": st.weights_staged,
    }))
    .into_response()
}

/// `GET /model_info` (and `/get_model_info`). `model_path` is the local `--model-path` or null,
/// so routers never try to download a tokenizer.
pub async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "model_path": state.args.model_path.as_ref().map(|p| p.display().to_string()),
        "tokenizer_path": Value::Null,
        "is_generation": true,
        "preferred_sampling_params": Value::Null,
        "weight_version": state.core.status().weight_version,
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }))
    .into_response()
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let name = state.args.served_name();
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": name, "object": "model", "created": now_s() as u64, "owned_by": "troupe",
            "root": name, "max_model_len": state.config.max_position_embeddings,
        }],
    }))
    .into_response()
}

/// `GET /get_load`: SGLang's legacy per-DP-rank load list.
pub async fn get_load(State(state): State<Arc<AppState>>) -> Response {
    let st = state.core.status();
    axum::Json(json!([{
        "dp_rank": 0,
        "num_reqs": st.num_running_reqs + st.num_waiting_reqs,
        "num_waiting_reqs": st.num_waiting_reqs,
        "num_tokens": st.num_used_tokens,
        "num_pending_tokens": 0,
        "ts_tic": now_s(),
    }]))
    .into_response()
}

/// `GET /v1/loads`.
pub async fn loads(State(state): State<Arc<AppState>>) -> Response {
    let st = state.core.status();
    let cap = state.args.kv_pool_tokens(&state.config);
    axum::Json(json!({
        "timestamp": now_s(),
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": st.num_running_reqs,
            "num_waiting_reqs": st.num_waiting_reqs,
            "num_total_reqs": st.num_running_reqs + st.num_waiting_reqs,
            "num_used_tokens": st.num_used_tokens,
            "max_total_num_tokens": cap,
            "token_usage": st.num_used_tokens as f64 / cap.max(1) as f64,
            "gen_throughput": st.last_gen_throughput,
            "max_running_requests": state.args.max_running_requests,
        }],
    }))
    .into_response()
}

/// `GET /get_weight_version`.
pub async fn weight_version(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"weight_version": state.core.status().weight_version})).into_response()
}

/// `GET /metrics`: Prometheus text, with SGLang's metric names.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let st = state.core.status();
    let label = format!("{{model_name=\"{}\"}}", state.args.served_name());
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{label} {value}\n"
        ));
    };
    metric(
        "sglang:num_running_reqs",
        "gauge",
        "Requests in the running batch.",
        st.num_running_reqs.to_string(),
    );
    metric(
        "sglang:num_queue_reqs",
        "gauge",
        "Requests waiting.",
        st.num_waiting_reqs.to_string(),
    );
    metric(
        "sglang:num_used_tokens",
        "gauge",
        "KV positions in use.",
        st.num_used_tokens.to_string(),
    );
    metric(
        "sglang:gen_throughput",
        "gauge",
        "Decode throughput of the last step (tokens/s).",
        st.last_gen_throughput.to_string(),
    );
    metric(
        "sglang:prompt_tokens_total",
        "counter",
        "Prompt tokens prefilled.",
        st.prompt_tokens_total.to_string(),
    );
    metric(
        "sglang:cached_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        st.cached_tokens_total.to_string(),
    );
    metric(
        "sglang:cache_hit_rate",
        "gauge",
        "Share of prompt tokens served from the prefix cache since start.",
        (st.cached_tokens_total as f64 / st.prompt_tokens_total.max(1) as f64).to_string(),
    );
    metric(
        "troupe_engine_prefix_cache_tokens",
        "gauge",
        "Tokens held by the prefix cache.",
        st.prefix_cache_tokens.to_string(),
    );
    metric(
        "troupe_engine_kv_received_tokens_total",
        "counter",
        "PD decode: prompt KV positions received from prefill servers.",
        st.kv_received_tokens_total.to_string(),
    );
    metric(
        "troupe_engine_kv_local_tokens_total",
        "counter",
        "PD decode: prompt KV positions taken from this server's own prefix cache.",
        st.kv_local_tokens_total.to_string(),
    );
    metric(
        "sglang:generation_tokens_total",
        "counter",
        "Tokens generated.",
        st.generation_tokens_total.to_string(),
    );
    metric(
        "sglang:num_requests_total",
        "counter",
        "Requests finished.",
        st.requests_finished_total.to_string(),
    );
    metric(
        "sglang:num_aborted_requests_total",
        "counter",
        "Requests aborted.",
        st.requests_aborted_total.to_string(),
    );
    metric(
        "troupe_engine_weight_updates_total",
        "counter",
        "Weight updates applied.",
        st.weight_updates_total.to_string(),
    );
    metric(
        "troupe_engine_paused",
        "gauge",
        "1 while generation is paused.",
        u8::from(st.paused.is_some()).to_string(),
    );
    if let Some(rooms) = &state.rooms {
        metric(
            "troupe_engine_pd_rooms",
            "gauge",
            "KV rooms awaiting pickup.",
            rooms.len().to_string(),
        );
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
