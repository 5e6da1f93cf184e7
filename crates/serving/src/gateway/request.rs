//! A parsed inference request ([`InferReq`]): just enough of the client's body for the gateway
//! to route, retry and split it, and nothing more. Both the non-stream attempts
//! ([`super::forward`]) and the streaming ones ([`super::stream`]) read it, so it lives below
//! both.

use axum::body::Bytes;
use axum::http::HeaderMap;
use serde_json::{Map, Value};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use super::route_text::RouteText;
use troupe_http::error::ApiError;
use troupe_router::metrics::Endpoint;
use troupe_router::pd;
use troupe_router::policy::RouteContext;

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
    /// The weight version the request asks for (`super::version_pin`), if any.
    pub(crate) want: Option<troupe_wire::want::VersionWant>,
}

/// The longest request id a client may give (`rid`, `request_id`, `X-Request-Id`).
pub(crate) const MAX_ID_BYTES: usize = 256;

/// A 400 for a request id of `len` bytes, named by `what`.
fn too_long(what: &str, len: usize) -> ApiError {
    ApiError::bad_request(format!(
        "{what} is {len} bytes, over the {MAX_ID_BYTES} a request id may have; use a shorter id"
    ))
}

/// vLLM's token-in/token-out route (served with `--enable-scale-out`).
pub(crate) const VLLM_GENERATE: &str = ep::InferenceGenerate::PATH;

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
        Self::from_object(ep, headers, obj, raw, pd_mode, needs_text)
    }

    /// [`InferReq::parse`] of a body the caller has as an object already (`raw` is its JSON):
    /// the agent layer's `/generate`, whose token ids are not parsed back.
    pub(super) fn from_object(
        ep: Endpoint,
        headers: &HeaderMap,
        mut obj: Map<String, Value>,
        raw: Bytes,
        pd_mode: bool,
        needs_text: bool,
    ) -> Result<Self, ApiError> {
        let (want, raw) = super::version_pin::take(headers, &mut obj, raw)?;
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
            want,
        })
    }

    /// Gives a single request an id when the client sent none, so it can be aborted by id
    /// (`/abort_request {rid}`, `/abort_requests {request_ids}`) and found in the engines' logs.
    /// The client's id is, first to last: the body's `rid` (SGLang's field), its `request_id`
    /// (vLLM's), the `X-Request-Id` header (which vLLM's servers read); else the gateway makes
    /// one. The body every worker gets carries it as `rid` (SGLang and the reference engine;
    /// a vLLM worker's `/generate` translation turns it into `request_id`) and, on the OpenAI
    /// routes and vLLM's own token route, as `request_id` too (vLLM reads that there).
    /// Returns the id, which the gateway sends back in `X-Request-Id`; `None` for batches
    /// (a list of prompts, or `n` above 1 on the OpenAI routes).
    ///
    /// An id longer than [`MAX_ID_BYTES`], in the body or the header, is refused (400) rather
    /// than echoed: a 100 KB id in `X-Request-Id` makes clients drop the answer
    /// (`LineTooLong`), as session keys are capped.
    pub(crate) fn ensure_rid(&mut self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        if self.batch.is_some() || !self.single() {
            return Ok(None);
        }
        let header = headers.get("x-request-id");
        if let Some(h) = header
            && h.len() > MAX_ID_BYTES
        {
            return Err(too_long("the X-Request-Id header", h.len()));
        }
        let from_body = |obj: &Map<String, Value>, k: &str| match obj.get(k) {
            Some(Value::String(r)) if !r.is_empty() => Some(Some(r.clone())),
            None | Some(Value::Null) => None,
            Some(_) => Some(None),
        };
        let native = self
            .native
            .as_ref()
            .and_then(|n| serde_json::from_slice::<Map<String, Value>>(n).ok());
        let found = from_body(&self.obj, "rid")
            .or_else(|| from_body(&self.obj, "request_id"))
            .or_else(|| native.as_ref().and_then(|n| from_body(n, "request_id")));
        let rid = match found {
            Some(Some(r)) if r.len() > MAX_ID_BYTES => {
                return Err(too_long("the request's rid / request_id", r.len()));
            }
            Some(Some(r)) => r,
            // A non-string id: the engine will refuse or ignore it; not one to abort by.
            Some(None) => return Ok(None),
            None => header
                .and_then(|h| h.to_str().ok())
                .filter(|h| !h.is_empty())
                .map_or_else(
                    || format!("troupe-{}", uuid::Uuid::new_v4().simple()),
                    str::to_string,
                ),
        };
        let id = Value::String(rid.clone());
        let mut add: Vec<(&str, Value)> = Vec::with_capacity(2);
        if !self.obj.contains_key("rid") {
            add.push(("rid", id.clone()));
        }
        if self.ep != Endpoint::Generate && !self.obj.contains_key("request_id") {
            add.push(("request_id", id.clone()));
        }
        if !add.is_empty() {
            self.raw = pd::append_fields(&self.raw, self.obj.is_empty(), &add);
            for (k, v) in add {
                self.obj.insert(k.into(), v);
            }
        }
        if let (Some(n), Some(obj)) = (&self.native, &native)
            && !obj.contains_key("request_id")
        {
            self.native = Some(pd::append_fields(n, obj.is_empty(), &[("request_id", id)]));
        }
        Ok(Some(rid))
    }

    /// One generation: not a list of prompts, and at most one choice (`n`).
    fn single(&self) -> bool {
        let one_choice = match self.obj.get("n") {
            None | Some(Value::Null) => true,
            Some(n) => n.as_u64() == Some(1),
        };
        let one_prompt = match (self.ep, self.obj.get("prompt")) {
            (Endpoint::Completions, Some(Value::Array(a))) => {
                a.len() == 1 || a.iter().all(Value::is_u64)
            }
            _ => true,
        };
        one_choice && one_prompt
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
