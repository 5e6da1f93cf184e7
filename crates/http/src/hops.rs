//! Loop detection: every request a gateway forwards says which gateways it has passed.
//!
//! A gateway registered as its own worker (or two gateways registered as each other's) turned
//! one request into a recursion: a fleet pause called itself until 20,000 descriptors were
//! gone. Registration refuses a worker that is this gateway by address
//! (`gateway/register.rs`), but a loop through other gateways, a proxy or another spelling of
//! the address cannot be seen there. So each gateway has an id, and every request it sends
//! upstream (forwarded inference, fleet control fan-outs, registration probes) carries
//! [`VIA_HEADER`]: the ids of the gateways the request it serves has passed, then its own. A
//! request arriving with the gateway's own id in it, or past [`MAX_HOPS`] gateways, is answered
//! 508 (Loop Detected) at once instead of forwarded again. The gateway that sent such a
//! request first, from a client, then removes the worker that answered 508 ([`Hop::is_first`]):
//! every request routed to it would loop again.

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue, StatusCode};

use crate::error::ApiError;

/// The header listing the gateways a request has passed, comma-separated, oldest first.
pub const VIA_HEADER: &str = "x-troupe-via";

/// Most gateways one request may pass.
pub const MAX_HOPS: usize = 8;

tokio::task_local! {
    /// The via chain to send upstream while serving one request: its incoming chain and this
    /// gateway's id.
    static CHAIN: HeaderValue;
}

/// A gateway's place in via chains: its id, and the chain of a request that passed no gateway
/// before (built once: most requests come straight from clients).
#[derive(Debug, Clone)]
pub struct Hop {
    id: Arc<str>,
    alone: HeaderValue,
}

impl Hop {
    /// A fresh gateway id.
    pub fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Hop {
            alone: HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("gateway")),
            id: Arc::from(id),
        }
    }

    /// The id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the request being served reached this gateway through no other gateway: the
    /// chain it sends upstream is this gateway's id alone. Only then does a 508 from a worker
    /// say something about that worker, not about the client: the client chose nothing of what
    /// the worker was sent (a client's own via header makes the chain longer), so the loop or
    /// the over-long chain lies behind the worker (`gateway/register.rs` drops it).
    pub fn is_first(&self) -> bool {
        current().is_some_and(|c| c == self.alone)
    }
}

impl Default for Hop {
    fn default() -> Self {
        Self::new()
    }
}

/// The ids in a request's via header.
fn chain(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(VIA_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

/// The chain a request to gateway `hop` is served with (its own chain, then this gateway's
/// id), or the 508 that refuses it: it has looped back here, or passed [`MAX_HOPS`] gateways.
/// Run the request's handler [`within`] the chain, so what it sends upstream carries it.
pub fn enter(hop: &Hop, headers: &HeaderMap, path: &str) -> Result<HeaderValue, ApiError> {
    if !headers.contains_key(VIA_HEADER) {
        return Ok(hop.alone.clone());
    }
    let me = &*hop.id;
    let seen = chain(headers);
    if seen.contains(&me) {
        return Err(ApiError::new(
            StatusCode::LOOP_DETECTED,
            format!(
                "{path} came back to the gateway that forwarded it: a worker of this gateway is the gateway itself (or reaches it); remove that worker"
            ),
        ));
    }
    if seen.len() >= MAX_HOPS {
        return Err(ApiError::new(
            StatusCode::LOOP_DETECTED,
            format!(
                "{path} has passed {} gateways; at most {MAX_HOPS} are allowed (are gateways registered as each other's workers?)",
                seen.len()
            ),
        ));
    }
    let mut ids: Vec<&str> = seen;
    ids.push(me);
    HeaderValue::from_str(&ids.join(","))
        .map_err(|_| ApiError::bad_request(format!("{VIA_HEADER} must be printable text")))
}

/// Runs `f` (a request's handler) with `chain` ([`enter`]'s) as the chain what it sends
/// upstream carries.
pub async fn within<F: std::future::Future>(chain: HeaderValue, f: F) -> F::Output {
    CHAIN.scope(chain, f).await
}

/// Runs `f` as gateway `hop` serving no request (its own start-up work, such as probing the
/// workers of its config).
pub async fn as_gateway<F: std::future::Future>(hop: &Hop, f: F) -> F::Output {
    CHAIN.scope(hop.alone.clone(), f).await
}

/// The chain to send upstream from the request being served, if any.
pub fn current() -> Option<HeaderValue> {
    CHAIN.try_with(Clone::clone).ok()
}

/// `f`, carrying the chain of the request being served into a task spawned for it.
pub fn carry<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
    let chain = current();
    async move {
        match chain {
            Some(c) => CHAIN.scope(c, f).await,
            None => f.await,
        }
    }
}
