//! The fleet control endpoints: SGLang's names and bodies ([`sglang`]), vLLM's native RL routes
//! and SkyRL's names ([`vllm`]), Troupe's CPU weight push ([`tensor`]) and `POST /scale` (`scale.rs`,
//! servers joining and leaving a deployment), each applying to
//! every engine of the fleet through one [`ControlPlane`] and answering once with a per-engine
//! breakdown.
//!
//! [`router`] serves them from a plane in this process (a standalone `troupe gateway`, or the
//! controller's own control server, [`serve`]); [`forwarder`] serves the same paths by passing
//! each request to another server's plane (the gateway of `troupe serve`, whose plane lives in
//! the controller so that it is the fleet's one truth). Both serve the gateway's routes of
//! `troupe_wire::routes::ROUTES`.

mod scale;
mod sglang;
mod tensor;
mod vllm;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use troupe_fleet::control_plane::ControlPlane;
use troupe_http::error::{ApiError, ServingError};
use troupe_http::keys::{KeyedRoutes, Paths};
use troupe_http::listen::ServeLimits;
use troupe_http::upstream::{UpstreamClient, bearer, read_body};

/// Whether `path` is a gateway control route that changes something (keyed).
fn mutating(path: &str) -> bool {
    troupe_wire::routes::find(path)
        .is_some_and(|r| r.side != troupe_wire::routes::Side::Engine && r.mutates)
}

/// Whether `path` is a gateway control route that only reads (open unless reads are keyed).
fn reading(path: &str) -> bool {
    troupe_wire::routes::find(path)
        .is_some_and(|r| r.side != troupe_wire::routes::Side::Engine && !r.mutates)
}

/// Who may call the control endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlAuth {
    /// `Authorization: Bearer <key>` required on routes that change something; the read-only
    /// ones (versions, server and model info, `is_paused`) are open, as on SGLang and vLLM.
    Key(String),
    /// The key required on every control route, reads included.
    KeyAll(String),
    /// Open (only ever on a loopback listener, or with no admin key configured at all).
    Open,
}

impl ControlAuth {
    /// The key rule of the control routes, for the server's [`KeyedRoutes`]: the one check,
    /// made from the request head before a body is read.
    pub fn keyed(&self, routes: KeyedRoutes) -> KeyedRoutes {
        const WHAT: &str = "a fleet control endpoint";
        match self {
            ControlAuth::Key(k) => routes.with_control(Paths::Where(mutating), Some(k), WHAT),
            ControlAuth::KeyAll(k) => routes
                .with_control(Paths::Where(mutating), Some(k), WHAT)
                .with_control(Paths::Where(reading), Some(k), WHAT),
            ControlAuth::Open => routes,
        }
    }
}

/// The control endpoints served from `plane`. Weight pushes (`/update_weights_from_tensor`)
/// may be up to `max_tensor_bytes`; every other body is bounded by the server's own limit. Who
/// may call them is the server's [`KeyedRoutes`] ([`ControlAuth::keyed`]), which
/// `troupe_http::listen::serve` checks before any handler: serve these routes only through it.
pub(crate) fn router(plane: Arc<ControlPlane>, max_tensor_bytes: usize) -> axum::Router {
    sglang::routes()
        .merge(vllm::routes())
        .merge(tensor::routes(max_tensor_bytes))
        .merge(scale::routes())
        .with_state(plane)
}

/// The control endpoints answered by the plane behind `upstream` (another server's
/// [`router`]), passed on with `key` as their bearer. Bodies up to `max_tensor_bytes` pass.
/// Keys are checked as for [`router`].
pub(crate) fn forwarder(
    upstream: Upstream,
    client: UpstreamClient,
    key: Option<String>,
    max_tensor_bytes: usize,
) -> Result<axum::Router, ServingError> {
    let key = bearer(key.as_deref(), "admin_key").map_err(ServingError::Config)?;
    let fwd = Arc::new(Forward {
        upstream,
        client,
        key,
    });
    let mut r = axum::Router::new();
    for p in troupe_wire::routes::gateway_paths() {
        r = r.route(p, axum::routing::any(forward));
    }
    Ok(r.with_state(fwd)
        .layer(axum::extract::DefaultBodyLimit::max(max_tensor_bytes)))
}

/// Where a forwarding gateway sends control requests; settable while it runs (a controller
/// that recovers a deployment opens a new control server).
pub type Upstream = Arc<parking_lot::RwLock<Option<String>>>;

struct Forward {
    upstream: Upstream,
    client: UpstreamClient,
    /// `Bearer <admin key>`, if any.
    key: Option<HeaderValue>,
}

async fn forward(State(f): State<Arc<Forward>>, req: Request) -> Response {
    let Some(base) = f.upstream.read().clone() else {
        return ApiError::unavailable(
            "the fleet's control plane is not attached to this gateway yet; retry shortly",
        )
        .control()
        .into_response();
    };
    let (parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let url = format!("{}{pq}", base.trim_end_matches('/'));
    let uri: axum::http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            return ApiError::bad_gateway(format!("the control plane's address {url}: {e}"))
                .control()
                .into_response();
        }
    };
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(format!("reading the body: {e}")).into_response(),
    };
    let sent = f.client.request(
        parts.method,
        uri,
        bytes,
        parts.headers.get(header::CONTENT_TYPE),
        f.key.as_ref(),
        None,
    );
    let answered = async {
        let resp = sent
            .await
            .map_err(|e| format!("the fleet's control plane is unreachable: {e}"))?;
        let status = resp.status();
        let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
        let b = read_body(resp)
            .await
            .map_err(|e| format!("the control plane's answer broke off: {e}"))?;
        Ok::<_, String>((status, ct, b))
    };
    let limit = troupe_fleet::engine_client::CONTROL_TIMEOUT * 10;
    match tokio::time::timeout(limit, answered).await {
        Ok(Ok((status, ct, b))) => {
            let mut r = Response::new(Body::from(b));
            *r.status_mut() = status;
            if let Some(ct) = ct {
                r.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            r
        }
        Ok(Err(e)) => ApiError::bad_gateway(e).control().into_response(),
        Err(_) => ApiError::bad_gateway(format!(
            "the fleet's control plane did not answer in {limit:?}"
        ))
        .control()
        .into_response(),
    }
}

/// Parses a JSON body into `T`, naming the field that is wrong; an empty body is `{}` (the
/// engine protocol's one parser, `troupe_wire::routes::body`).
pub(crate) fn body<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    troupe_wire::routes::body::parse(bytes)
}

/// A JSON answer (200).
pub(crate) fn json(v: serde_json::Value) -> Response {
    axum::Json(v).into_response()
}

/// The controller's control server: [`router`] on its own listener, for a forwarding gateway
/// (and any client that reaches the controller) to call.
pub struct ControlServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl ControlServer {
    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving: open responses get up to 5 s to finish, then the server is dropped
    /// (an idle keep-alive connection from a gateway must not hold up a teardown).
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(std::time::Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

impl Drop for ControlServer {
    /// Dropped without `shutdown` (its deployment was dropped): stop at once, nothing outlives
    /// the owner.
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
            self.task.abort();
        }
    }
}

/// Serves `plane`'s control endpoints on `listen` (`host:0` picks a port). Without an admin
/// key it must be a loopback address: these endpoints pause every engine and load weights.
pub async fn serve(
    plane: Arc<ControlPlane>,
    listen: &str,
    admin_key: Option<String>,
    limits: ServeLimits,
    max_tensor_bytes: usize,
) -> Result<ControlServer, ServingError> {
    limits.check().map_err(ServingError::Config)?;
    let listener = troupe_http::client::bind(listen).await?;
    let addr = listener.local_addr()?;
    let auth = match admin_key {
        Some(k) => ControlAuth::Key(k),
        None if addr.ip().is_loopback() => ControlAuth::Open,
        None => {
            return Err(ServingError::Config(format!(
                "refusing to serve fleet control on {addr} without an admin key; set one or listen on 127.0.0.1"
            )));
        }
    };
    let keys = auth.keyed(KeyedRoutes::open());
    let app = router(plane, max_tensor_bytes);
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(troupe_http::listen::serve(
        listener,
        app,
        limits,
        keys,
        None,
        async {
            let _ = rx.await;
        },
    ));
    Ok(ControlServer {
        addr,
        stop: Some(tx),
        task,
    })
}
