//! The host side of `CallStream` as one stream tonic polls itself: requests are read and
//! dispatched to their actors in arrival order (keeping each caller's order per actor) and
//! replies go out as they complete.
//!
//! Why not a task per stream feeding a channel: that puts two more cross-task wake-ups (task →
//! channel → tonic) on every call's round trip, which on a loopback call is a large share of
//! the whole. Polled in place, a reply is encoded by the task that saw its actor finish.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, Stream, StreamExt};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::{Status, Streaming};
use troupe_wire::v1::{self, call_reply};

use crate::error::CallError;
use crate::host::HostCore;

/// The reply to call `call_id`.
pub(crate) fn reply(call_id: u64, r: Result<Vec<u8>, CallError>) -> v1::CallReply {
    v1::CallReply {
        call_id,
        result: Some(match r {
            Ok(p) => call_reply::Result::Payload(p),
            Err(e) => call_reply::Result::Error(e.to_wire()),
        }),
    }
}

/// A call's deadline from the wire (0 = none).
pub(crate) fn deadline(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// The replies of one call stream.
pub(crate) struct CallReplies {
    inbound: Streaming<v1::CallRequest>,
    inflight: FuturesUnordered<BoxFuture<'static, v1::CallReply>>,
    /// Replies known at dispatch (unknown actor, host shutting down), sent first.
    ready: VecDeque<v1::CallReply>,
    open: bool,
    core: HostCore,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl CallReplies {
    /// The replies to `inbound`'s calls on `core`; the stream ends when the host stops, or
    /// when the caller closed its side and every reply went out.
    pub(crate) fn new(core: HostCore, inbound: Streaming<v1::CallRequest>) -> Self {
        CallReplies {
            stop: Box::pin(core.stopped().cancelled_owned()),
            inbound,
            inflight: FuturesUnordered::new(),
            ready: VecDeque::new(),
            open: true,
            core,
        }
    }
}

impl Stream for CallReplies {
    type Item = Result<v1::CallReply, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        while this.open {
            match this.inbound.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(r))) => {
                    match this.core.dispatch(&r.actor_id, r.method, r.payload) {
                        Ok(rx) => {
                            let core = this.core.clone();
                            let (id, d) = (r.call_id, deadline(r.deadline_ms));
                            this.inflight.push(Box::pin(async move {
                                reply(id, core.await_reply(rx, d).await)
                            }));
                        }
                        Err(e) => this.ready.push_back(reply(r.call_id, Err(e))),
                    }
                }
                Poll::Ready(Some(Err(_)) | None) => this.open = false,
                Poll::Pending => break,
            }
        }
        if let Some(r) = this.ready.pop_front() {
            return Poll::Ready(Some(Ok(r)));
        }
        match this.inflight.poll_next_unpin(cx) {
            Poll::Ready(Some(r)) => Poll::Ready(Some(Ok(r))),
            Poll::Ready(None) if !this.open => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}
