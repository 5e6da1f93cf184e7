//! [`UpstreamClient`]: the HTTP client for workers and engines: the gateway forwards inference
//! requests over it, data proxies ([`troupe_serving::proxy`]) pass requests to their engine over it, and
//! [`troupe_fleet::engine_client::EngineClient`] makes its control calls over it.
//!
//! It is the serving crates' one HTTP client: health probes ([`crate::probe`]) and the control
//! forwarder use it too. Why not `reqwest`: a forwarded request needs none of reqwest's layers
//! (redirect policy, retry layer, URL to URI conversion, request builder), and profiling the
//! gateway at 64 concurrent requests put them at about a tenth of its CPU per request. This is hyper's pooled HTTP/1 client with the same
//! settings: connections reused (up to 1024 idle per worker, 90 s), TCP_NODELAY, plain HTTP
//! only (workers are reached over plain HTTP; [`troupe_router::worker::parse_url`]), no proxies, no
//! redirects, a 5 s connect timeout. Per-request deadlines are the caller's. The engines'
//! control calls ([`troupe_fleet::engine_client::EngineClient`]) go over it too: a fleet-wide pause
//! is one call per engine, and at 512 engines its CPU is the controller's fan-out cost.
//!
//! Whole-body exchanges ([`UpstreamClient::full`], [`UpstreamClient::post_full`]: every
//! non-streamed inference request and every engine control call) skip hyper's client and its
//! connection tasks: the calling task writes and reads a pooled connection itself
//! ([`crate::h1`]). Streams, and bodies over [`crate::h1::MAX_BODY`], go through hyper.
//!
//! Each thread running a single-threaded runtime gets a pool of its own (dropped with the
//! thread, so a later thread never inherits connections of a runtime that is gone). hyper runs
//! every pooled connection as a task on the runtime that opened it; a request that borrows a
//! connection opened on another runtime hands its bytes to that runtime's thread and waits to
//! be woken back, two cross-thread wake-ups per request. So a gateway serving on single-threaded runtimes (one per
//! core, [`troupe_serving::gateway::GatewayConfig::io_threads`]) keeps a request, its upstream connection
//! and its response on one thread (0.065-0.087 ms added at one request in flight, against 0.105
//! ms on a two-worker runtime). Multi-threaded runtimes share one pool: their tasks move between
//! workers anyway, and a pool per worker only opened more connections (a controller's fan-out
//! to 512 engines had its p99 go from about 160 to about 200 ms with one, same day).

use std::cell::RefCell;
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use troupe_wire::error_chain;

use crate::h1::{Extra, H1Pool};

type Pool = Client<HttpConnector, Full<Bytes>>;

/// One client's pools on one thread: hyper's, and the whole-body exchanges' ([`H1Pool`]).
struct ThreadPools {
    owner: Weak<u8>,
    hyper: Pool,
    h1: Arc<H1Pool>,
}

thread_local! {
    /// This thread's pools for use on a single-threaded runtime: one per client (by its `id`),
    /// dropped with the thread, or once the client is gone.
    static POOLS: RefCell<Vec<ThreadPools>> = const { RefCell::new(Vec::new()) };
}

/// A pooled HTTP/1 client for workers and engines: one pool for multi-threaded runtimes, and
/// one per thread running a single-threaded runtime. Cheap to clone: clones share the pools.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    shared: Pool,
    /// Idle connections of whole-body exchanges on multi-threaded runtimes.
    shared_h1: Arc<H1Pool>,
    /// Identifies this client (and its clones) among a thread's pools.
    id: Arc<u8>,
    /// Thread pools made for this client (tests).
    #[cfg(test)]
    made: Arc<std::sync::atomic::AtomicUsize>,
}

impl Default for UpstreamClient {
    fn default() -> Self {
        Self::new()
    }
}

impl UpstreamClient {
    /// A client with its own pools.
    pub fn new() -> Self {
        UpstreamClient {
            shared: new_pool(),
            shared_h1: Arc::default(),
            id: Arc::new(0),
            #[cfg(test)]
            made: Arc::default(),
        }
    }

    /// Sends `req` over the pool for the runtime this runs on: the thread's own on a
    /// single-threaded runtime, the shared one otherwise.
    pub(crate) fn send(&self, req: Request<Full<Bytes>>) -> ResponseFuture {
        self.on_pools(|p| match p {
            Some(p) => p.hyper.request(req),
            None => self.shared.request(req),
        })
    }

    /// The whole-body exchanges' pool for the runtime this runs on, chosen as [`Self::send`]'s.
    fn h1(&self) -> Arc<H1Pool> {
        self.on_pools(|p| p.map_or_else(|| self.shared_h1.clone(), |p| p.h1.clone()))
    }

    /// `f(this thread's pools)` on a single-threaded runtime (made on first use), else
    /// `f(None)`: the shared ones.
    fn on_pools<R>(&self, f: impl FnOnce(Option<&ThreadPools>) -> R) -> R {
        use tokio::runtime::{Handle, RuntimeFlavor};
        if !matches!(
            Handle::try_current().map(|h| h.runtime_flavor()),
            Ok(RuntimeFlavor::CurrentThread)
        ) {
            return f(None);
        }
        POOLS.with(|pools| {
            let mut pools = pools.borrow_mut();
            let me = Arc::as_ptr(&self.id);
            if let Some(p) = pools.iter().find(|p| p.owner.as_ptr() == me) {
                return f(Some(p));
            }
            // A miss: drop the pools of clients that are gone, then add this one's.
            pools.retain(|p| p.owner.strong_count() > 0);
            #[cfg(test)]
            self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = ThreadPools {
                owner: Arc::downgrade(&self.id),
                hyper: new_pool(),
                h1: Arc::default(),
            };
            let out = f(Some(&p));
            pools.push(p);
            out
        })
    }

    /// The whole answer (status and body) to a request whose body is known up front: on a
    /// pooled connection this task drives itself ([`crate::h1`]), or through hyper when the
    /// body is over [`crate::h1::MAX_BODY`]. Headers as [`Self::request`]'s; the answer's
    /// headers are not kept.
    pub async fn full(
        &self,
        method: Method,
        uri: Uri,
        body: Bytes,
        content_type: Option<&HeaderValue>,
        auth: Option<&HeaderValue>,
        if_match: Option<&HeaderValue>,
    ) -> Result<(StatusCode, Bytes), String> {
        if body.len() > crate::h1::MAX_BODY {
            let r = self
                .request(method, uri, body, content_type, auth, if_match)
                .await?;
            let status = r.status();
            return read_body(r).await.map(|b| (status, b));
        }
        let via = crate::hops::current();
        let extra = Extra {
            content_type,
            auth,
            if_match,
            via: via.as_ref(),
        };
        self.h1().exchange(&method, &uri, extra, &body).await
    }

    /// [`Self::full`] of a `POST` with a JSON `body`.
    pub async fn post_full(
        &self,
        uri: Uri,
        body: Bytes,
        auth: Option<&HeaderValue>,
    ) -> Result<(StatusCode, Bytes), String> {
        let json = HeaderValue::from_static("application/json");
        self.full(Method::POST, uri, body, Some(&json), auth, None)
            .await
    }

    /// `POST uri` with a JSON `body` and `auth` (if any) as its `Authorization`; the response as
    /// it arrives (read its body with [`read_body`] or stream it).
    pub async fn post(
        &self,
        uri: Uri,
        body: Bytes,
        auth: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        self.post_if(uri, body, auth, None).await
    }

    /// [`UpstreamClient::post`] with an `If-Match` header when given (a conditional control
    /// call: the engine acts only if it holds that version).
    pub async fn post_if(
        &self,
        uri: Uri,
        body: Bytes,
        auth: Option<&HeaderValue>,
        if_match: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        let json = HeaderValue::from_static("application/json");
        self.request(Method::POST, uri, body, Some(&json), auth, if_match)
            .await
    }

    /// `GET uri` with `auth` (if any) as its `Authorization`.
    pub async fn get(
        &self,
        uri: Uri,
        auth: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        self.request(Method::GET, uri, Bytes::new(), None, auth, None)
            .await
    }

    /// Any request: `body` with `content_type`, `auth` (as its `Authorization`) and the
    /// caller's `If-Match`, each if any: what a data proxy passes through, so a conditional
    /// call stays conditional.
    pub async fn request(
        &self,
        method: Method,
        uri: Uri,
        body: Bytes,
        content_type: Option<&HeaderValue>,
        auth: Option<&HeaderValue>,
        if_match: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        let h = req.headers_mut();
        if let Some(ct) = content_type {
            h.insert(header::CONTENT_TYPE, ct.clone());
        }
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, a.clone());
        }
        if let Some(tag) = if_match {
            h.insert(header::IF_MATCH, tag.clone());
        }
        // Served on behalf of a gateway's request: say which gateways it passed.
        if let Some(via) = crate::hops::current() {
            h.insert(crate::hops::VIA_HEADER, via);
        }
        self.send(req).await.map_err(|e| error_chain(&e))
    }
}

/// A pool with the settings above.
fn new_pool() -> Pool {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(TokioTimer::new())
        .build(conn)
}

/// `Bearer <key>` as a header value (marked sensitive, so it is never logged); `None` for no
/// key. Fails, naming `what`, when the key cannot be a header value (a control character).
pub fn bearer(key: Option<&str>, what: &str) -> Result<Option<HeaderValue>, String> {
    let Some(k) = key else { return Ok(None) };
    let mut v = HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
        format!(
            "{what} must be printable text (no control characters or newlines): it is sent as an HTTP header"
        )
    })?;
    v.set_sensitive(true);
    Ok(Some(v))
}

/// Reads a whole response body.
pub async fn read_body(resp: Response<Incoming>) -> Result<Bytes, String> {
    use http_body_util::BodyExt;
    resp.into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| error_chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_with_a_newline_is_refused_with_its_name() {
        let e = bearer(Some("a\nb"), "worker_api_key").unwrap_err();
        assert!(e.contains("worker_api_key"), "{e}");
        let v = bearer(Some("sk-1"), "worker_api_key").unwrap().unwrap();
        assert_eq!(v.to_str().unwrap(), "Bearer sk-1");
        assert!(bearer(None, "worker_api_key").unwrap().is_none());
    }

    #[test]
    fn single_threaded_runtimes_get_pools_of_their_own_and_multi_threaded_ones_share() {
        use std::sync::atomic::Ordering::Relaxed;
        let c = UpstreamClient::new();
        let on_own_thread = |c: UpstreamClient| {
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    drop(c.send(Request::default()));
                    drop(c.send(Request::default()));
                });
            })
            .join()
            .unwrap()
        };
        // One pool per thread (two calls on one thread share it), none reused by a later
        // thread: its connections ran on a runtime that is gone.
        on_own_thread(c.clone());
        assert_eq!(c.made.load(Relaxed), 1);
        on_own_thread(c.clone());
        assert_eq!(c.made.load(Relaxed), 2);
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let c2 = c.clone();
        multi
            .block_on(async move {
                tokio::spawn(async move { drop(c2.send(Request::default())) }).await
            })
            .unwrap();
        assert_eq!(
            c.made.load(Relaxed),
            2,
            "a multi-threaded runtime uses the shared pool"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_names_its_cause() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let up = UpstreamClient::new();
        let uri: Uri = format!("http://{addr}/generate").parse().unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), up.post(uri, Bytes::new(), None))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.contains("onnect"), "{e}");
    }
}
