//! [`bind`] for the gateway's and the proxies' listeners (serving them is
//! [`crate::listen::serve`]) and their default body limit. The outbound client is
//! [`crate::upstream::UpstreamClient`], the one the data path, the engine client and the
//! health probes share.

use super::error::ServingError;

/// The default largest request body of the gateway and the DataProxy: 32 MiB. A 128k-token
/// prompt as JSON token ids is about 1 MiB, so this leaves room for batches while refusing
/// bodies that only tie up memory; raise `max_body_bytes` where larger batches are sent.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

/// Binds `addr` (`host:port`; port 0 picks a free one).
pub async fn bind(addr: &str) -> Result<tokio::net::TcpListener, ServingError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServingError::Bind {
            addr: addr.to_string(),
            source,
        })
}
