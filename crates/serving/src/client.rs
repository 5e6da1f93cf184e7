//! The outbound HTTP client shared by gateway, proxy and health checks.
//!
//! One pooled client per server: connections to workers are reused (a new TCP handshake per
//! request would dominate the gateway's added latency), TCP_NODELAY is set (small JSON bodies
//! and SSE events must not wait for Nagle), and environment proxies are ignored (a stray
//! `http_proxy` must never reroute cluster-internal traffic).

use std::time::Duration;

use super::error::ServingError;

/// Builds the pooled, no-proxy, TCP_NODELAY client.
pub fn build() -> Result<reqwest::Client, ServingError> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(Duration::from_secs(90))
        .connect_timeout(Duration::from_secs(5))
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

/// Serves `app` on `listener` with TCP_NODELAY on every accepted socket until `shutdown`
/// resolves, then lets open responses finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
