//! [`probe`]: a health check over the [`UpstreamClient`]: `GET url` within a deadline, the
//! status kept and the body read (bounded) and dropped, so the connection goes back to the
//! pool.
//!
//! Why here: the gateway's health prober, an inference server's start-up wait, the
//! re-placement's fence and the control forwarder all reach workers and engines, and they
//! use the one client stack the data path and the engine client use (hyper's pooled client,
//! `upstream.rs`), not a second one.

use std::time::Duration;

use axum::http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use troupe_wire::error_chain;

use crate::upstream::UpstreamClient;

/// Most bytes of a probe's answer that are read before it is dropped: health answers are a
/// few bytes; anything longer only costs memory.
const MAX_PROBE_BODY: usize = 64 << 10;

/// Why a probe has no status.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Nothing accepted the connection: nothing listens there (yet).
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// Connected, but no whole answer in time, or the exchange broke, or `url` is no URL.
    #[error("{0}")]
    Failed(String),
}

/// `GET url` within `timeout` over `client`: the answer's status once its body (up to 64 KiB)
/// has been read.
pub async fn probe(
    client: &UpstreamClient,
    url: &str,
    timeout: Duration,
) -> Result<StatusCode, ProbeError> {
    let uri: Uri = url
        .parse()
        .map_err(|e| ProbeError::Failed(format!("{url}: {e}")))?;
    let mut req = Request::new(Full::default());
    *req.uri_mut() = uri;
    let exchange = async {
        let resp = client.send(req).await.map_err(|e| {
            if e.is_connect() {
                ProbeError::Unreachable(error_chain(&e))
            } else {
                ProbeError::Failed(error_chain(&e))
            }
        })?;
        let status = resp.status();
        // Read so the connection is reused; a longer answer is cut, which only closes it.
        let _ = Limited::new(resp.into_body(), MAX_PROBE_BODY)
            .collect()
            .await;
        Ok(status)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(ProbeError::Failed(format!("no answer in {timeout:?}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_is_unreachable_and_a_bad_url_fails() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let c = UpstreamClient::new();
        let e = probe(
            &c,
            &format!("http://127.0.0.1:{port}/health"),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, ProbeError::Unreachable(_)), "{e}");
        let e = probe(&c, "not a url", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(e, ProbeError::Failed(_)), "{e}");
    }

    #[tokio::test]
    async fn a_server_that_answers_gives_its_status() {
        let app = axum::Router::new().route(
            "/health",
            axum::routing::get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "warming up") }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(l, app).await });
        let c = UpstreamClient::new();
        let s = probe(&c, &format!("http://{addr}/health"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        server.abort();
    }
}
