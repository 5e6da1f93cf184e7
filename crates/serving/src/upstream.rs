//! [`UpstreamClient`]: the HTTP client for workers and engines: the gateway forwards inference
//! requests over it, data proxies ([`crate::proxy`]) pass requests to their engine over it, and
//! [`crate::engine_client::EngineClient`] makes its control calls over it.
//!
//! Why not the pooled `reqwest` client of [`crate::client::build`] (the health probes' and the
//! control API's forwarder): a forwarded request needs none of reqwest's layers (redirect policy, retry layer, URL to URI
//! conversion, request builder), and profiling the gateway at 64 concurrent requests put them
//! at about a tenth of its CPU per request. This is hyper's pooled HTTP/1 client with the same
//! settings: connections reused (up to 1024 idle per worker, 90 s), TCP_NODELAY, plain HTTP
//! only (workers are reached over plain HTTP; [`crate::worker::parse_url`]), no proxies, no
//! redirects, a 5 s connect timeout. Per-request deadlines are the caller's. The engines'
//! control calls ([`crate::engine_client::EngineClient`]) go over it too: a fleet-wide pause
//! is one call per engine, and at 512 engines its CPU is the controller's fan-out cost.
//!
//! Each thread gets its own pool. hyper runs every pooled connection as a task on the runtime
//! of the thread that opened it; a request that borrows a connection opened by another thread
//! hands its bytes to that thread and waits to be woken back, two cross-thread wake-ups per
//! request. With a pool per thread, a gateway serving on single-threaded runtimes (one per
//! core, [`crate::gateway::GatewayConfig::io_threads`]) keeps a request, its upstream
//! connection and its response on one thread (one such thread: 0.065-0.069 ms added at one
//! request in flight, against 0.105 ms on a two-worker runtime sharing one pool).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderValue, Method, Request, Response, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use troupe_wire::error_chain;

type Pool = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1 client for workers and engines, one pool per thread that uses it. Cheap to
/// clone: clones share the pools; they close with the last clone.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    pools: Arc<thread_local::ThreadLocal<Pool>>,
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
            pools: Arc::new(thread_local::ThreadLocal::new()),
        }
    }

    /// This thread's pool.
    fn pool(&self) -> &Pool {
        self.pools.get_or(|| {
            let mut conn = HttpConnector::new();
            conn.set_nodelay(true);
            conn.set_connect_timeout(Some(Duration::from_secs(5)));
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1024)
                .pool_idle_timeout(Duration::from_secs(90))
                .pool_timer(TokioTimer::new())
                .build(conn)
        })
    }

    /// `POST uri` with a JSON `body` and `auth` (if any) as its `Authorization`; the response as
    /// it arrives (read its body with [`read_body`] or stream it).
    pub async fn post(
        &self,
        uri: Uri,
        body: Bytes,
        auth: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        let json = HeaderValue::from_static("application/json");
        self.request(Method::POST, uri, body, Some(&json), auth)
            .await
    }

    /// `GET uri` with `auth` (if any) as its `Authorization`.
    pub async fn get(
        &self,
        uri: Uri,
        auth: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, String> {
        self.request(Method::GET, uri, Bytes::new(), None, auth)
            .await
    }

    /// Any request: `body` with `content_type` (if any) and `auth` (if any) as its
    /// `Authorization`; what a data proxy passes through.
    pub async fn request(
        &self,
        method: Method,
        uri: Uri,
        body: Bytes,
        content_type: Option<&HeaderValue>,
        auth: Option<&HeaderValue>,
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
        self.pool().request(req).await.map_err(|e| error_chain(&e))
    }
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
