//! [`HeldBody`]: a response body that keeps something alive until the body is sent in full or
//! dropped (the client went away). What a response occupies (a worker's in-flight count, a
//! connection's busy mark) must cover the whole body, not just until the headers leave: a
//! streamed generation occupies its server until the last event.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

/// A body that holds `T` (guards, marks) until it is finished or dropped.
pub struct HeldBody<T> {
    inner: Body,
    _held: T,
}

impl<T: Send + Unpin + 'static> HeldBody<T> {
    /// Wraps `inner`; `held` drops with the body.
    pub fn new(inner: Body, held: T) -> Self {
        Self { inner, _held: held }
    }

    /// As an axum body.
    pub fn into_body(self) -> Body {
        Body::new(self)
    }
}

impl<T: Unpin> HttpBody for HeldBody<T> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Mark(Arc<AtomicUsize>);
    impl Drop for Mark {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn what_it_holds_drops_when_the_body_is_read_or_dropped() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let b = HeldBody::new(Body::from("abc"), Mark(dropped.clone())).into_body();
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        let bytes = axum::body::to_bytes(b, 16).await.unwrap();
        assert_eq!(&bytes[..], b"abc");
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        drop(HeldBody::new(Body::empty(), Mark(dropped.clone())));
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }
}
