//! `/generate`: submitting items to the scheduler (with the PD KV fetch on a decode server),
//! collecting their events, and rendering SGLang's response shapes, streamed or not.
//!
//! Stream chunks follow current SGLang: `text` is cumulative, `output_ids` holds only the new
//! ids of this chunk, `meta_info` logprob lists are cumulative, `finish_reason` is null until
//! the last chunk; batch chunks carry `index`; the stream ends with `data: [DONE]`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::AppState;
use super::error::{ApiError, parse_object};
use super::parse::{GenItem, parse_generate};
use crate::config::DisaggMode;
use crate::core::admit::{self, SharedCache};
use crate::core::sequence::output_text;
use crate::core::{Command, FinishReason, SeqEvent, SeqKind, SeqRequest};
use crate::model::KvCache;
use crate::pd::fetch_kv;
use crate::rng::mix;
use crate::tokenizer;

/// Checks an item against this server's role and model before anything is submitted, and
/// refuses it (503, retryable) while a vLLM `/pause` in `abort` or `wait` mode holds.
pub fn check_item(state: &AppState, item: &GenItem) -> Result<(), ApiError> {
    if state.vllm.rejecting() {
        return Err(ApiError::unavailable(
            "generation is paused (POST /pause in abort or wait mode) and refuses new requests until POST /resume; retry then",
        ));
    }
    if item.input_ids.is_empty() {
        return Err(ApiError::bad_request(
            "the prompt is empty; send at least one token",
        ));
    }
    let ctx = state.config.max_position_embeddings;
    if item.input_ids.len() >= ctx {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} tokens but the model's context is {ctx}; shorten it",
            item.input_ids.len()
        )));
    }
    match state.mode {
        DisaggMode::Null => {}
        DisaggMode::Prefill | DisaggMode::Decode => {
            if item.bootstrap.room.is_none() {
                return Err(ApiError::bad_request(format!(
                    "bootstrap_room is required on a {} server (disaggregation mode); send the request through a PD router or add bootstrap_host, bootstrap_port and bootstrap_room",
                    state.mode.as_str()
                )));
            }
            if state.mode == DisaggMode::Decode && item.bootstrap.host.is_none() {
                return Err(ApiError::bad_request(
                    "bootstrap_host is required on a decode server: it names the prefill server to fetch KV from",
                ));
            }
        }
    }
    Ok(())
}

/// Submits a checked item and returns its event stream.
pub fn start_item(state: &Arc<AppState>, item: &GenItem) -> mpsc::UnboundedReceiver<SeqEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = item.input_ids.len();
    let logprob_start = if item.logprob_start_len < 0 {
        n - 1
    } else {
        (item.logprob_start_len as usize).min(n - 1)
    };
    let seed = item
        .params
        .sampling_seed
        .unwrap_or_else(|| match item.bootstrap.room {
            Some(room) => mix(state.args.random_seed, room),
            None => mix(
                state.args.random_seed,
                state
                    .counter
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ),
        });
    let mut req = SeqRequest {
        rid: item.rid.clone(),
        input_ids: item.input_ids.clone(),
        params: item.params.clone(),
        seed,
        return_logprob: item.return_logprob,
        logprob_start,
        kind: SeqKind::Regular,
        events: tx.clone(),
    };
    match (state.mode, item.bootstrap.room) {
        (DisaggMode::Prefill, Some(room)) => {
            req.kind = SeqKind::Prefill { room };
            submit(state, req, &tx);
        }
        (DisaggMode::Decode, Some(room)) => {
            let host = item
                .bootstrap
                .host
                .clone()
                .unwrap_or_else(|| "127.0.0.1".into());
            let port = item
                .bootstrap
                .port
                .unwrap_or(state.args.disaggregation_bootstrap_port);
            let state = state.clone();
            let secret = state.args.bootstrap_secret();
            tokio::spawn(async move {
                let local = |version: &str, kv_len: usize| {
                    local_prefix(state.core.prefix_cache(), &req.input_ids, version, kv_len)
                };
                let fetched = tokio::select! {
                    r = fetch_kv(&host, port, room, state.kv_timeout, secret.as_ref(), local) => r,
                    _ = tx.closed() => return,
                };
                let checked = fetched.and_then(|h| {
                    if h.input_ids != req.input_ids {
                        return Err(format!(
                            "prefill for room {room} computed KV for a different prompt ({} tokens, here {}); prefill and decode must receive the same request",
                            h.input_ids.len(),
                            req.input_ids.len()
                        ));
                    }
                    if !h.cache.matches(&state.config) {
                        return Err("prefill KV does not fit this model; prefill and decode must run the same --model".into());
                    }
                    check_handoff(&h, &state.config)?;
                    Ok(h)
                });
                match checked {
                    Ok(h) => {
                        req.kind = SeqKind::Decode(Box::new(h));
                        submit(&state, req, &tx);
                    }
                    Err(msg) => {
                        tracing::warn!(room, %msg, "KV handoff failed");
                        let _ = tx.send(SeqEvent::Finished {
                            reason: FinishReason::Abort(format!("KV transfer failed: {msg}")),
                            weight_version: state.core.status().weight_version,
                            cached_tokens: 0,
                        });
                    }
                }
            });
        }
        _ => submit(state, req, &tx),
    }
    rx
}

/// What a PD decode server already holds of a prompt whose KV a prefill offers: its prefix
/// cache's entry for these tokens if it was computed by the same weight version, else nothing.
fn local_prefix(
    cache: Option<SharedCache>,
    input_ids: &[u32],
    version: &str,
    kv_len: usize,
) -> KvCache {
    let Some(cache) = cache else {
        return KvCache::default();
    };
    let mut pc = admit::lock(&cache);
    if pc.version() != version {
        return KvCache::default();
    }
    let hit = pc.lookup(input_ids, kv_len);
    if let Some(l) = hit.lock {
        pc.unlock(l);
    }
    hit.cache
}

fn submit(state: &AppState, req: SeqRequest, tx: &mpsc::UnboundedSender<SeqEvent>) {
    if state.core.send(Command::Submit(Box::new(req))).is_err() {
        let _ = tx.send(SeqEvent::Finished {
            reason: FinishReason::Abort("engine is shutting down".into()),
            weight_version: String::new(),
            cached_tokens: 0,
        });
    }
}

/// Accumulated state of one item.
#[derive(Debug, Clone)]
pub struct ItemState {
    /// The request.
    pub item: GenItem,
    /// Generated tokens and logprobs.
    pub output: Vec<(u32, f32)>,
    /// Prompt logprobs.
    pub input_lps: Vec<(Option<f32>, u32)>,
    /// Set when done.
    pub finish: Option<FinishReason>,
    /// Weight version at finish.
    pub weight_version: String,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    started: Instant,
    sent: usize,
}

impl ItemState {
    /// Fresh state for an item.
    pub fn new(item: GenItem) -> Self {
        Self {
            item,
            output: Vec::new(),
            input_lps: Vec::new(),
            finish: None,
            weight_version: String::new(),
            cached_tokens: 0,
            started: Instant::now(),
            sent: 0,
        }
    }

    /// Folds one event in.
    pub fn apply(&mut self, ev: SeqEvent) {
        match ev {
            SeqEvent::InputLogprobs(l) => self.input_lps = l,
            SeqEvent::Tokens(t) => self.output.extend(t),
            SeqEvent::Finished {
                reason,
                weight_version,
                cached_tokens,
            } => {
                self.finish = Some(reason);
                self.weight_version = weight_version;
                self.cached_tokens = cached_tokens;
            }
        }
    }

    /// Output token ids.
    pub fn ids(&self) -> Vec<u32> {
        self.output.iter().map(|(t, _)| *t).collect()
    }

    /// Output text as SGLang returns it (stop trimming applied at the end).
    pub fn text(&self) -> String {
        output_text(
            &self.ids(),
            self.finish.as_ref(),
            self.item.params.no_stop_trim,
        )
    }

    fn lp_entry(&self, lp: Option<f32>, id: u32) -> Value {
        let text = if self.item.return_text_in_logprobs {
            json!(tokenizer::token_text(id))
        } else {
            Value::Null
        };
        json!([lp, id, text])
    }

    /// `meta_info` as SGLang renders it.
    pub fn meta_info(&self, version_now: &str) -> Value {
        let version = if self.weight_version.is_empty() {
            version_now
        } else {
            &self.weight_version
        };
        let mut m = json!({
            "id": self.item.rid,
            "finish_reason": self.finish.as_ref().map(FinishReason::to_json),
            "prompt_tokens": self.item.input_ids.len(),
            "completion_tokens": self.output.len(),
            "cached_tokens": self.cached_tokens,
            "weight_version": version,
            "e2e_latency": self.started.elapsed().as_secs_f64(),
        });
        if self.item.return_logprob {
            m["input_token_logprobs"] = Value::Array(
                self.input_lps
                    .iter()
                    .map(|(lp, id)| self.lp_entry(*lp, *id))
                    .collect(),
            );
            m["output_token_logprobs"] = Value::Array(
                self.output
                    .iter()
                    .map(|(id, lp)| self.lp_entry(Some(*lp), *id))
                    .collect(),
            );
        }
        m
    }

    /// The full (non-stream) response object.
    pub fn to_json(&self, version_now: &str) -> Value {
        json!({"text": self.text(), "output_ids": self.ids(), "meta_info": self.meta_info(version_now)})
    }

    /// A stream chunk: cumulative text, the ids since the last chunk.
    pub fn chunk(&mut self, version_now: &str) -> Value {
        let new_ids: Vec<u32> = self.output[self.sent..].iter().map(|(t, _)| *t).collect();
        self.sent = self.output.len();
        json!({"text": self.text(), "output_ids": new_ids, "meta_info": self.meta_info(version_now)})
    }
}

/// What a decode takes from a prefill must be a valid continuation of this model: a
/// first token in the vocabulary with a real logprob, KV for exactly the prompt and within the
/// context, and finite numbers only (a broken or hostile prefill must not poison the batch).
fn check_handoff(h: &crate::pd::KvHandoff, config: &crate::ModelConfig) -> Result<(), String> {
    if h.first_token as usize >= config.vocab_size {
        return Err(format!(
            "prefill sent first token {} outside the vocabulary of {}",
            h.first_token, config.vocab_size
        ));
    }
    if !(h.first_logprob.is_finite() && h.first_logprob <= 0.0) {
        return Err(format!("prefill sent first logprob {}", h.first_logprob));
    }
    if h.cache.len != h.input_ids.len() || h.cache.len > config.max_position_embeddings {
        return Err(format!(
            "prefill sent KV for {} positions for a {}-token prompt (context {})",
            h.cache.len,
            h.input_ids.len(),
            config.max_position_embeddings
        ));
    }
    if h.cache
        .layers
        .iter()
        .any(|l| l.k.iter().chain(&l.v).any(|x| !x.is_finite()))
    {
        return Err("prefill sent KV with non-finite values".into());
    }
    Ok(())
}

/// Waits for an item to finish.
pub async fn collect(mut st: ItemState, mut rx: mpsc::UnboundedReceiver<SeqEvent>) -> ItemState {
    while st.finish.is_none() {
        match rx.recv().await {
            Some(ev) => st.apply(ev),
            None => st.finish = Some(FinishReason::Abort("engine stopped".into())),
        }
    }
    st
}

/// Events of one item rendered as stream chunks by `render`, called once per batch of
/// available events; the last call sees the finished state.
pub fn item_chunks<F>(
    st: ItemState,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    render: F,
) -> impl Stream<Item = Value> + Send
where
    F: FnMut(&mut ItemState) -> Value + Send + 'static,
{
    futures::stream::unfold(Some((st, rx, render)), |s| async move {
        let (mut st, mut rx, mut render) = s?;
        match rx.recv().await {
            Some(ev) => st.apply(ev),
            None => st.finish = Some(FinishReason::Abort("engine stopped".into())),
        }
        while st.finish.is_none()
            && let Ok(ev) = rx.try_recv()
        {
            st.apply(ev);
        }
        let out = render(&mut st);
        let next = if st.finish.is_some() {
            None
        } else {
            Some((st, rx, render))
        };
        Some((out, next))
    })
}

/// An SSE response from a stream of JSON values, ending with `data: [DONE]`.
pub fn sse(stream: impl Stream<Item = Value> + Send + 'static) -> Response {
    let body = stream
        .map(|v| Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {v}\n\n"))))
        .chain(futures::stream::once(async {
            Ok(Bytes::from_static(b"data: [DONE]\n\n"))
        }));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// `POST /generate`.
pub async fn generate(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&body)?;
    let req = parse_generate(&obj)?;
    for item in &req.items {
        check_item(&state, item)?;
    }
    let started: Vec<(ItemState, mpsc::UnboundedReceiver<SeqEvent>)> = req
        .items
        .into_iter()
        .map(|item| {
            let rx = start_item(&state, &item);
            (ItemState::new(item), rx)
        })
        .collect();
    if req.stream {
        let is_batch = req.is_batch;
        let streams = started.into_iter().enumerate().map(|(i, (st, rx))| {
            let state = state.clone();
            item_chunks(st, rx, move |s| {
                let mut c = s.chunk(&state.core.status().weight_version);
                if is_batch {
                    c["index"] = json!(i);
                }
                c
            })
            .boxed()
        });
        return Ok(sse(futures::stream::select_all(streams)));
    }
    let version = state.core.status().weight_version;
    let done = futures::future::join_all(started.into_iter().map(|(st, rx)| collect(st, rx))).await;
    let out: Vec<Value> = done.iter().map(|s| s.to_json(&version)).collect();
    Ok(axum::Json(if req.is_batch {
        Value::Array(out)
    } else {
        out.into_iter().next().unwrap_or(Value::Null)
    })
    .into_response())
}
