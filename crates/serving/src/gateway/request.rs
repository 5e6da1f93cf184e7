//! A parsed inference request ([`InferReq`]): just enough of the client's body for the gateway
//! to route, retry and split it, and nothing more. Both the non-stream attempts
//! ([`super::forward`]) and the streaming ones ([`super::stream`]) read it, so it lives below
//! both.

use axum::body::Bytes;
use axum::http::HeaderMap;
use serde_json::{Map, Value};

use super::route_text::RouteText;
use crate::error::ApiError;
use crate::metrics::Endpoint;
use crate::pd;
use crate::policy::RouteContext;

/// A parsed inference request.
#[derive(Debug)]
pub(crate) struct InferReq {
    pub(crate) ep: Endpoint,
    pub(crate) raw: Bytes,
    pub(crate) obj: Map<String, Value>,
    pub(crate) stream: bool,
    pub(crate) batch: Option<usize>,
    pub(crate) logprob: bool,
    pub(crate) session: Option<String>,
    /// Where the routing text is in `obj` (found only when a policy reads it).
    pub(crate) text: RouteText,
    /// The client's own vLLM body of `/inference/v1/generate` (`raw` is its SGLang
    /// translation): a worker that speaks vLLM gets this, unchanged, on that path.
    pub(crate) native: Option<Bytes>,
}

/// vLLM's token-in/token-out route (served with `--enable-scale-out`).
pub(crate) const VLLM_GENERATE: &str = "/inference/v1/generate";

impl InferReq {
    /// Parses `raw` as a request to `ep`: the fields the gateway acts on, checked (a bad
    /// `stream`, a prompt list PD cannot split), and the routing text when a policy reads it.
    pub(super) fn parse(
        ep: Endpoint,
        headers: &HeaderMap,
        raw: Bytes,
        pd_mode: bool,
        needs_text: bool,
    ) -> Result<Self, ApiError> {
        let obj = pd::parse_object(&raw)?;
        let stream = match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "stream must be true or false, got {v}"
                )));
            }
        };
        let (batch, logprob) = match ep {
            Endpoint::Generate => (pd::batch_size(&obj), pd::wants_logprob(&obj)),
            Endpoint::Completions => {
                if pd_mode
                    && let Some(Value::Array(a)) = obj.get("prompt")
                    && a.len() > 1
                    && a.iter().all(Value::is_string)
                {
                    return Err(ApiError::bad_request(
                        "a list of prompts in /v1/completions is not supported in PD mode; send one prompt per request or use /generate with a text list",
                    ));
                }
                (None, false)
            }
            Endpoint::ChatCompletions => (None, false),
        };
        let session = super::session_key::session_key(headers, &obj)?;
        let text = if needs_text {
            RouteText::of(ep, &obj)
        } else {
            RouteText::None
        };
        Ok(Self {
            ep,
            raw,
            obj,
            stream,
            batch,
            logprob,
            session,
            text,
            native: None,
        })
    }

    /// Gives a single SGLang-style `/generate` request an id when the client sent none, so it
    /// can be aborted by id (`/abort_request {rid}`): `rid` is added to the body every worker
    /// gets (SGLang's and the reference engine's field; vLLM workers get it as `request_id`).
    /// Returns the request's id, the client's or the new one, which the gateway sends back in
    /// `X-Request-Id`; `None` for batches, other routes and bodies in vLLM's own dialect.
    pub(crate) fn ensure_rid(&mut self) -> Option<String> {
        if self.ep != Endpoint::Generate || self.batch.is_some() || self.native.is_some() {
            return None;
        }
        match self.obj.get("rid") {
            Some(Value::String(r)) => return Some(r.clone()),
            Some(_) => return None,
            None => {}
        }
        let rid = format!("troupe-{}", uuid::Uuid::new_v4().simple());
        let field = [("rid", Value::String(rid.clone()))];
        self.raw = pd::append_fields(&self.raw, self.obj.is_empty(), &field);
        self.obj.insert("rid".into(), Value::String(rid.clone()));
        Some(rid)
    }

    /// The request's id (`rid`), when it has one.
    pub(crate) fn rid(&self) -> Option<&str> {
        self.obj.get("rid").and_then(Value::as_str)
    }

    pub(crate) fn ctx(&self) -> RouteContext<'_> {
        RouteContext {
            session: self.session.as_deref(),
            text: self.text.get(&self.obj),
        }
    }
}
