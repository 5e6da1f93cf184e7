//! The DataProxy: an HTTP server in front of one inference server (or, by override, a list of
//! backend addresses, used round-robin).
//!
//! Everything is forwarded unchanged, except that a single, non-stream `/generate` runs the
//! pause-aware **abort → resubmit** loop rollouts rely on: when the backend answers with
//! `meta_info.finish_reason.type == "abort"` (a weight update paused generation with mode
//! `abort`), the proxy waits until the backend is no longer paused (polling `/server_info`'s
//! `internal_states[].paused`), then resubmits the prompt plus the tokens generated so far
//! (`input_ids` = prompt ids + output ids; for a `text` prompt, `text` = prompt + output text)
//! with the remaining `max_new_tokens` (and `min_new_tokens`) budget, and stitches the pieces
//! into one response.
//!
//! The stitched response is the backend's last answer with `output_ids`, `text`,
//! `meta_info.completion_tokens`, `meta_info.output_token_logprobs` covering all pieces (and a
//! `length` finish counting all of them),
//! `meta_info.prompt_tokens` / `input_token_logprobs` of the original prompt, and two added
//! fields:
//! - `meta_info.output_token_weight_versions`: one entry per output token, the
//!   `weight_version` of the backend answer that produced it (a piece's tokens all come from
//!   the weights in force when that piece ended: pauses land between scheduler steps);
//! - `meta_info.proxy_resubmits`: how many times the request was resubmitted.
//!
//! Streams and batches are forwarded unchanged (no resubmit). The proxy serves with the same
//! connection timeouts and body limit as the gateway ([`troupe_http::listen`]), and its errors, and
//! a backend's non-JSON error answers, are the JSON error envelope ([`troupe_http::envelope`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod generate;
mod openai;

use troupe_http::client;
use troupe_http::coalesce::Coalesced;
use troupe_http::error::{ApiError, ServingError};
use troupe_http::listen::{self, ServeLimits};
use troupe_http::redact::redact;
use troupe_http::upstream::{UpstreamClient, bearer, read_body};
use troupe_router::worker::parse_url;

/// SGLang's default `max_new_tokens` when a request gives none.
const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// What a DataProxy is started from.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
    /// Backend base URLs (`http://host:port`), used round-robin. Usually one: the server this
    /// proxy fronts.
    pub backends: Vec<String>,
    /// Most resubmissions of one request.
    pub max_resubmits: u32,
    /// How often a paused backend is polled.
    pub pause_poll: Duration,
    /// Longest wait for a paused backend before answering with the partial output.
    pub pause_wait: Duration,
    /// Bearer key sent to the backend when the client sent none.
    pub backend_api_key: Option<String>,
    /// Connection bounds and the body limit ([`ServeLimits`]; the gateway's defaults, with a
    /// body limit of the gateway's plus 1 MiB, so a body the gateway took is never refused by
    /// the hop behind it: the fields it adds, `rid` and PD's bootstrap fields, fit). Weight
    /// pushes never pass through a proxy: their limit is the body limit.
    pub limits: ServeLimits,
}

impl ProxyConfig {
    /// The connection bounds and body limit the proxy serves with.
    pub fn limits(&self) -> ServeLimits {
        ServeLimits {
            max_weights_bytes: self.limits.max_body_bytes,
            ..self.limits
        }
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            backends: Vec::new(),
            max_resubmits: 64,
            pause_poll: Duration::from_millis(20),
            pause_wait: Duration::from_secs(600),
            backend_api_key: None,
            // The gateway's client-facing limit plus room for the fields it adds (`rid`, PD's
            // bootstrap fields): a body the gateway took is never refused by the hop behind it.
            limits: ServeLimits {
                max_body_bytes: client::DEFAULT_MAX_BODY_BYTES + (1 << 20),
                ..ServeLimits::default()
            },
        }
    }
}

#[derive(Debug)]
struct ProxyState {
    cfg: ProxyConfig,
    backends: Vec<String>,
    next: AtomicUsize,
    resubmits: AtomicU64,
    client: UpstreamClient,
    /// `Bearer <backend_api_key>`, sent when the client sent no `Authorization`.
    key: Option<HeaderValue>,
}

impl ProxyState {
    fn backend(&self) -> &str {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        &self.backends[i]
    }

    /// The client's own `Authorization`, else the backend key's.
    fn auth<'a>(&'a self, headers: &'a HeaderMap) -> Option<&'a HeaderValue> {
        headers.get(header::AUTHORIZATION).or(self.key.as_ref())
    }

    /// `backend` + `path` as a URI (backends are `http://host:port`, checked at start).
    fn uri(backend: &str, path: &str) -> Result<Uri, String> {
        format!("{backend}{path}")
            .parse()
            .map_err(|e| format!("{backend}{path} is not a valid URL: {e}"))
    }
}

/// A running DataProxy.
#[derive(Debug)]
pub struct ProxyHandle {
    addr: SocketAddr,
    state: Arc<ProxyState>,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
}

impl ProxyHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Resubmissions performed so far.
    pub fn resubmits(&self) -> u64 {
        self.state.resubmits.load(Ordering::Relaxed)
    }

    /// Stops accepting and lets open responses finish.
    pub async fn shutdown(mut self) -> Result<(), ServingError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match (&mut self.server).await {
            Ok(r) => r.map_err(ServingError::Io),
            Err(e) => Err(ServingError::Io(std::io::Error::other(e))),
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Starts a DataProxy.
pub async fn start(cfg: ProxyConfig) -> Result<ProxyHandle, ServingError> {
    if cfg.backends.is_empty() {
        return Err(ServingError::Config(
            "a DataProxy needs at least one backend address, e.g. backends = [\"http://127.0.0.1:30000\"]".into(),
        ));
    }
    let backends = cfg
        .backends
        .iter()
        .map(|b| {
            parse_url(b)
                .map(|(u, _)| u)
                .map_err(|e| ServingError::Config(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let limits = cfg.limits();
    limits.check().map_err(ServingError::Config)?;
    let key =
        bearer(cfg.backend_api_key.as_deref(), "backend_api_key").map_err(ServingError::Config)?;
    let state = Arc::new(ProxyState {
        backends,
        next: AtomicUsize::new(0),
        resubmits: AtomicU64::new(0),
        client: UpstreamClient::new(),
        key,
        cfg,
    });
    let listener = client::bind(&state.cfg.listen).await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(ep::Generate::PATH, post(generate::generate))
        .route(ep::Completions::PATH, post(openai::completions))
        .route(ep::ChatCompletions::PATH, post(openai::chat))
        .fallback(forward)
        .layer(DefaultBodyLimit::max(state.cfg.limits.max_body_bytes))
        .with_state(state.clone());
    let (tx, rx) = oneshot::channel::<()>();
    // Open: the backend checks its own keys, and no body here may pass max_body_bytes.
    let keys = troupe_http::keys::KeyedRoutes::open();
    let server = tokio::spawn(listen::serve(listener, app, limits, keys, None, async {
        let _ = rx.await;
    }));
    tracing::info!(%addr, backends = ?state.backends, "data proxy started");
    Ok(ProxyHandle {
        addr,
        state,
        shutdown: Some(tx),
        server,
    })
}

fn upstream_error(backend: &str, e: impl std::fmt::Display) -> Response {
    ApiError::bad_gateway(format!("backend {backend}: {e}")).into_response()
}

/// Any request other than a resubmittable `/generate`: forwarded as is, response streamed back.
async fn forward(State(state): State<Arc<ProxyState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, state.cfg.limits.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response();
        }
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    pass(&state, parts.method, path, &parts.headers, body).await
}

async fn pass(
    state: &ProxyState,
    method: axum::http::Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let backend = state.backend();
    let uri = match ProxyState::uri(backend, path) {
        Ok(u) => u,
        Err(e) => return upstream_error(backend, e),
    };
    let ct = headers.get(header::CONTENT_TYPE);
    let info = is_server_info(path);
    match state
        .client
        .request(
            method,
            uri,
            body,
            ct,
            state.auth(headers),
            headers.get(header::IF_MATCH),
        )
        .await
    {
        Ok(r) if info => redacted(r)
            .await
            .unwrap_or_else(|e| upstream_error(backend, e)),
        Ok(r) => {
            let mut out = Response::builder().status(r.status());
            if let Some(ct) = r.headers().get(header::CONTENT_TYPE) {
                out = out.header(header::CONTENT_TYPE, ct.clone());
            }
            out.body(Body::new(Coalesced::new(r.into_body())))
                .unwrap_or_else(|e| upstream_error(backend, e))
        }
        Err(e) => upstream_error(backend, e),
    }
}

/// SGLang's server-info routes (they echo the server's arguments, keys included).
fn is_server_info(path: &str) -> bool {
    let p = path.split('?').next().unwrap_or(path);
    matches!(p, ep::ServerInfo::PATH | ep::GetServerInfo::PATH)
}

/// A server-info answer with its secrets redacted: SGLang returns its launch arguments there,
/// the admin key among them, and the proxy must not hand them to whoever asks.
async fn redacted(r: axum::http::Response<Incoming>) -> Result<Response, String> {
    let status = r.status();
    let bytes = read_body(r).await?;
    let body = match serde_json::from_slice::<Value>(&bytes) {
        Ok(mut v) => {
            redact(&mut v);
            axum::body::Bytes::from(v.to_string())
        }
        Err(_) => bytes,
    };
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_routes_are_known() {
        assert!(is_server_info("/get_server_info?x=1"));
        assert!(!is_server_info("/generate"));
    }
}
