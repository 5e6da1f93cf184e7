//! [`Relay`]: an upstream SSE stream relayed to the client whole event by whole event.
//!
//! Events are relayed whole and in order (every event already whole in what arrived goes out
//! in one frame; [`troupe_http::coalesce`] then gathers what arrives in a burst), rewritten one by one
//! where PD asks for it (prefill's logprobs merged into each decode event), and a failure after
//! the first event ends the stream with one JSON error event and `data: [DONE]`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use serde_json::{Value, json};

use troupe_http::coalesce::MAX_FRAME;
use troupe_http::error::ApiError;
use troupe_http::sse::{self, EventSplitter};
use troupe_router::pd;
use troupe_router::worker::Worker;

/// The error event sent when a stream fails after it started (only the relay sends one, so it
/// lives here rather than in `stream.rs`, which uses the relay).
pub fn error_event(message: &str) -> Bytes {
    sse::event(&json!({"error": ApiError::bad_gateway(message).body()}))
}

/// The bytes of a worker's response body.
pub(super) type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, hyper::Error>> + Send>>;

/// An upstream SSE stream, split into whole events.
pub(super) struct Upstream {
    bytes: ByteStream,
    split: EventSplitter,
    worker: Arc<dyn Worker>,
}

impl Upstream {
    /// Reads `bytes` as `w`'s SSE stream.
    pub(super) fn new(bytes: ByteStream, w: &Arc<dyn Worker>) -> Self {
        Self {
            bytes,
            split: EventSplitter::default(),
            worker: w.clone(),
        }
    }

    /// The next whole event; `Ok(None)` at a clean end of stream.
    pub(super) async fn next(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            if let Some(ev) = self.split.next_event() {
                return Ok(Some(ev));
            }
            match self.bytes.next().await {
                Some(Ok(chunk)) => self.split.push(&chunk),
                Some(Err(e)) => return Err(self.failed(&e)),
                None => return Ok(None),
            }
        }
    }

    /// What a transport error `e` is called in the error event and in the logs.
    fn failed(&self, e: &hyper::Error) -> String {
        format!("{} {}: {e}", self.worker.worker_type(), self.worker.url())
    }
}

/// The client's body: the first event (already read, so the stream is known to have started),
/// then the rest of `up`.
pub(super) struct Relay {
    first: Option<Bytes>,
    /// `None` once `[DONE]` or a failure was relayed.
    up: Option<Upstream>,
    /// Prefill's answer to merge into each decode event (PD with `return_logprob`).
    prefill: Option<Arc<Value>>,
    /// Whole events read, not yet sent.
    out: BytesMut,
}

impl Relay {
    /// Relays `first` then what follows in `up`, each data event merged with `prefill` if any.
    pub(super) fn new(first: Bytes, up: Upstream, prefill: Option<Arc<Value>>) -> Self {
        let mut r = Self {
            first: None,
            up: Some(up),
            prefill,
            out: BytesMut::new(),
        };
        r.first = Some(r.rewrite(first));
        r
    }

    /// `ev` as the client gets it.
    fn rewrite(&self, ev: Bytes) -> Bytes {
        let Some(p) = &self.prefill else { return ev };
        let Some(d) = sse::data(&ev) else { return ev };
        match serde_json::from_str::<Value>(&d) {
            Ok(mut v) if v.is_object() && v.get("error").is_none() => {
                pd::merge_event(&mut v, p);
                sse::event(&v)
            }
            _ => ev,
        }
    }

    /// Moves every whole event buffered upstream into `out`; ends the stream at `[DONE]`.
    fn gather(&mut self) {
        while let Some(ev) = self.up.as_mut().and_then(|u| u.split.next_event()) {
            if sse::is_done(&ev) {
                if let Some(up) = self.up.take() {
                    up.worker.record_outcome(true);
                }
                self.out.extend_from_slice(&ev);
                return;
            }
            let ev = self.rewrite(ev);
            self.out.extend_from_slice(&ev);
        }
    }

    /// Ends the stream after a failure: an error event naming it, then `[DONE]`.
    fn fail(&mut self, message: &str) {
        if let Some(up) = self.up.take() {
            up.worker.record_outcome(false);
        }
        self.out.extend_from_slice(&error_event(message));
        self.out.extend_from_slice(sse::DONE);
    }

    fn send(&mut self) -> Poll<Option<Result<Bytes, Infallible>>> {
        Poll::Ready(Some(Ok(self.out.split().freeze())))
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        loop {
            this.gather();
            if this.out.len() >= MAX_FRAME {
                return this.send();
            }
            let Some(up) = this.up.as_mut() else {
                return if this.out.is_empty() {
                    Poll::Ready(None)
                } else {
                    this.send()
                };
            };
            match up.bytes.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(chunk))) => up.split.push(&chunk),
                Poll::Ready(Some(Err(e))) => {
                    let m = up.failed(&e);
                    this.fail(&m);
                }
                Poll::Ready(None) => {
                    let m = format!(
                        "{} {} closed the stream before [DONE]",
                        up.worker.worker_type(),
                        up.worker.url()
                    );
                    this.fail(&m);
                }
                Poll::Pending if this.out.is_empty() => return Poll::Pending,
                Poll::Pending => return this.send(),
            }
        }
    }
}
