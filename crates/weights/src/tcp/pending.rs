//! Handshakes read side by side: a listener keeps accepting while every connection it took
//! gets its own task with its own deadline, so one peer that connects and says nothing (or
//! trickles bytes) holds up neither the others nor the caller's deadline.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

/// Most handshakes in progress at once on one listener; past it the oldest is dropped. A real
/// peer answers within a round trip, so the oldest pending one is the likeliest stranger.
pub(crate) const MAX_PENDING: usize = 64;

/// The handshakes in progress on one listener.
pub(crate) struct Handshakes<T> {
    tasks: JoinSet<Option<T>>,
    /// In start order, to drop the oldest when full.
    order: VecDeque<AbortHandle>,
    /// Longest one handshake may take.
    each: Duration,
}

impl<T: Send + 'static> Handshakes<T> {
    /// Handshakes that may take `each` apiece.
    pub(crate) fn new(each: Duration) -> Self {
        Self {
            tasks: JoinSet::new(),
            order: VecDeque::new(),
            each,
        }
    }

    /// Accepts connections on `listener` and runs `shake` on each in its own task (bounded by
    /// `each` and `deadline`; a handshake that runs out of time is dropped, and `shake` gets
    /// the time it may take so it can say so), until one yields `Some`; `None` once `deadline`
    /// passes first. A failed `accept` (out of descriptors) is retried after a pause, not
    /// returned: strangers could otherwise cause it.
    pub(crate) async fn next<F, Fut>(
        &mut self,
        listener: &TcpListener,
        deadline: Instant,
        shake: F,
    ) -> Option<T>
    where
        F: Fn(TcpStream, SocketAddr, Instant) -> Fut,
        Fut: Future<Output = Option<T>> + Send + 'static,
    {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, from)) => {
                        let by = deadline.min(Instant::now() + self.each);
                        self.start(shake(stream, from, by), by);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a weight-transport connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(done) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    if let Ok(Some(t)) = done {
                        return Some(t);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return None,
            }
        }
    }

    fn start<Fut>(&mut self, shake: Fut, by: Instant)
    where
        Fut: Future<Output = Option<T>> + Send + 'static,
    {
        self.order.retain(|h| !h.is_finished());
        if self.order.len() >= MAX_PENDING
            && let Some(oldest) = self.order.pop_front()
        {
            tracing::warn!("too many weight-transport handshakes at once; dropping the oldest");
            oldest.abort();
        }
        // `shake` answers its own deadline with a reason; this only backs it up.
        let backstop = by + Duration::from_secs(1);
        let h = self.tasks.spawn(async move {
            tokio::time::timeout_at(backstop, shake)
                .await
                .ok()
                .flatten()
        });
        self.order.push_back(h);
    }
}
