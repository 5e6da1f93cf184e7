//! The outbound HTTP client shared by gateway, proxy and health checks, and [`bind`] for their
//! listeners (serving them is [`crate::listen::serve`]).
//!
//! One pooled client per server: connections to workers are reused (a new TCP handshake per
//! request would dominate the gateway's added latency), TCP_NODELAY is set (small JSON bodies
//! and SSE events must not wait for Nagle), and environment proxies are ignored (a stray
//! `http_proxy` must never reroute cluster-internal traffic), and redirects are not followed.

use std::time::Duration;

use super::error::ServingError;

/// The default largest request body of the gateway and the DataProxy: 32 MiB. A 128k-token
/// prompt as JSON token ids is about 1 MiB, so this leaves room for batches while refusing
/// bodies that only tie up memory; raise `max_body_bytes` where larger batches are sent.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

/// Builds the pooled, no-proxy, TCP_NODELAY client.
pub fn build() -> Result<reqwest::Client, ServingError> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(Duration::from_secs(90))
        .connect_timeout(Duration::from_secs(5))
        // A proxy passes a redirect through; following it would re-send the body elsewhere.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| ServingError::Client(e.to_string()))
}

/// Binds `addr` (`host:port`; port 0 picks a free one).
pub async fn bind(addr: &str) -> Result<tokio::net::TcpListener, ServingError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServingError::Bind {
            addr: addr.to_string(),
            source,
        })
}
