//! [`UpstreamClient`]: the gateway's client for the data path, forwarding inference requests to
//! workers.
//!
//! Why not the pooled `reqwest` client the control path uses ([`crate::client::build`]): a
//! forwarded request needs none of reqwest's layers (redirect policy, retry layer, URL to URI
//! conversion, request builder), and profiling the gateway at 64 concurrent requests put them
//! at about a tenth of its CPU per request. This is hyper's pooled HTTP/1 client with the same
//! settings: connections reused (up to 1024 idle per worker, 90 s), TCP_NODELAY, plain HTTP
//! only (workers are reached over plain HTTP; [`crate::worker::parse_url`]), no proxies, no
//! redirects, a 5 s connect timeout. Per-request deadlines are the caller's.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderValue, Method, Request, Response, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::error::ServingError;

/// A pooled HTTP/1 client that sends the workers' API key, if any, with every request.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    http: Client<HttpConnector, Full<Bytes>>,
    bearer: Option<HeaderValue>,
}

impl UpstreamClient {
    /// A client sending `api_key` (if any) as `Authorization: Bearer <key>`. Fails when the key
    /// cannot be a header value (a control character in it).
    pub fn new(api_key: Option<&str>) -> Result<Self, ServingError> {
        let bearer = match api_key {
            None => None,
            Some(k) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                    ServingError::Config(
                        "worker_api_key must be printable text (no control characters or newlines): it is sent as an HTTP header".into(),
                    )
                })?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        let http = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_timer(TokioTimer::new())
            .build(conn);
        Ok(UpstreamClient { http, bearer })
    }

    /// `POST uri` with a JSON `body`; the response as it arrives (read its body with
    /// [`read_body`] or stream it).
    pub async fn post(&self, uri: Uri, body: Bytes) -> Result<Response<Incoming>, String> {
        self.send(Method::POST, uri, Some(body)).await
    }

    /// `GET uri`.
    pub async fn get(&self, uri: Uri) -> Result<Response<Incoming>, String> {
        self.send(Method::GET, uri, None).await
    }

    async fn send(
        &self,
        method: Method,
        uri: Uri,
        body: Option<Bytes>,
    ) -> Result<Response<Incoming>, String> {
        let mut req = Request::new(Full::new(body.clone().unwrap_or_default()));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        let h = req.headers_mut();
        if body.is_some() {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        if let Some(b) = &self.bearer {
            h.insert(header::AUTHORIZATION, b.clone());
        }
        self.http.request(req).await.map_err(|e| chain(&e))
    }
}

/// Reads a whole response body.
pub async fn read_body(resp: Response<Incoming>) -> Result<Bytes, String> {
    use http_body_util::BodyExt;
    resp.into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| chain(&e))
}

/// An error with its causes, `outer: inner: ...`: hyper's own messages ("client error
/// (Connect)") say what failed only in their sources.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_with_a_newline_is_refused_with_its_name() {
        let e = UpstreamClient::new(Some("a\nb")).unwrap_err().to_string();
        assert!(e.contains("worker_api_key"), "{e}");
        assert!(UpstreamClient::new(Some("sk-1")).is_ok());
    }

    #[tokio::test]
    async fn a_refused_connection_names_its_cause() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let up = UpstreamClient::new(None).unwrap();
        let uri: Uri = format!("http://{addr}/generate").parse().unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), up.post(uri, Bytes::new()))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.contains("onnect"), "{e}");
    }
}
