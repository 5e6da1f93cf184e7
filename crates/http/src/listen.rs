//! Serving inbound HTTP (the gateway's and the DataProxy's listeners), with limits on how long a
//! connection may hold the server without sending a request.
//!
//! `axum::serve` has no read timeouts: a client that opened a connection and sent half a request
//! line kept it (and its task and socket) forever. Every connection here is served by hyper
//! directly, with three bounds:
//!
//! - **header read**: an HTTP/1 request head must be complete within
//!   [`ServeLimits::header_read_timeout`], counted from when the server starts waiting for it (the
//!   accept, or the end of the previous response on a keep-alive connection, so it also bounds an
//!   idle HTTP/1 keep-alive connection); past it hyper closes the connection.
//! - **body read**: the request body must arrive in full within
//!   [`ServeLimits::body_read_timeout`] ([`crate::envelope`] answers 408 otherwise).
//! - **idle**: a connection with no request in flight for [`ServeLimits::idle_timeout`] (before
//!   its first request: for the header read timeout, which covers a client that connects and
//!   sends nothing) is shut down gracefully (this is what bounds an idle HTTP/2 connection, which has no header
//!   timeout). A request counts as in flight until its response body is fully sent or dropped,
//!   so a long stream with quiet gaps is never cut.
//!
//! Every response also goes through [`crate::envelope`], which enforces the body, URI and header
//! limits and turns non-JSON error answers into the JSON error envelope.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::envelope::Front;
use crate::held::HeldBody;
use crate::hops::Hop;
use crate::keys::KeyedRoutes;

/// Most headers hyper itself parses. Above [`crate::envelope::MAX_HEADERS`] so that a request
/// with too many headers still reaches the envelope layer and gets a JSON 431; past this hyper
/// answers a bare 431 itself.
const HYPER_MAX_HEADERS: usize = 256;

pub use crate::limits::{DEFAULT_MAX_WEIGHTS_BYTES, ServeLimits, WEIGHTS_PATH};

/// What one connection's idle watcher needs: how many requests are in flight and since when
/// none has been. Requests only write these; the watcher reads them when its timer fires (no
/// wake-up per request: a notification on every request and response cost each forwarded
/// request two extra polls of its connection and a timer re-armed twice).
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    served: AtomicBool,
    idle_since: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
        }
    }

    /// When the connection becomes idle-expired, or `None` while a request is in flight. Before
    /// its first request a connection gets `first` (the header read timeout): a client that
    /// connects and sends nothing holds no HTTP/1 timer yet, since hyper is still waiting for
    /// the bytes that tell HTTP/1 from HTTP/2.
    fn deadline(&self, idle: Duration, first: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let wait = if self.served.load(Ordering::SeqCst) {
            idle
        } else {
            first.min(idle)
        };
        Some(*self.idle_since.lock() + wait)
    }
}

/// Marks one request in flight on its connection until dropped (it rides in the response
/// body, so it drops when the body is fully sent or the client goes away).
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: &Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::SeqCst);
        a.served.store(true, Ordering::SeqCst);
        Busy(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.idle_since.lock() = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether an accept error concerns only the one connection (keep accepting at once) rather
/// than the listener (e.g. out of file descriptors: back off).
fn per_connection(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves `app` on `listener` with TCP_NODELAY on every accepted socket, the connection bounds
/// and request limits of `limits`, the route keys of `keys` (checked before a body is read),
/// until `shutdown` resolves; then stops accepting, lets open responses finish and returns once
/// every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ServeLimits,
    keys: KeyedRoutes,
    hop: Option<Arc<Hop>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let front = Arc::new(Front { limits, keys, hop });
    let (stop_tx, stop_rx) = watch::channel(false);
    let (open_tx, open_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) if per_connection(&e) => continue,
                Err(e) => {
                    tracing::warn!("accept failed: {e}; retrying in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {e}");
        }
        tokio::spawn(connection(
            tcp,
            app.clone(),
            front.clone(),
            stop_rx.clone(),
            open_rx.clone(),
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    // Every connection task holds a receiver; `closed` resolves when the last one is gone.
    open_tx.closed().await;
    Ok(())
}

/// What the names of [`serve_on_threads`]'s threads start with (then their number), so tools
/// can find them (`troupe bench gateway` reads their CPU time).
pub const IO_THREAD_PREFIX: &str = "gateway-io-";

/// Serves `app` as [`serve`] does, on `threads` threads of its own, each running a
/// single-threaded runtime that accepts from `listener` (one thread per core, as nginx's
/// workers): a connection, the requests on it and the upstream calls they make (each thread
/// has its own pool in [`crate::upstream::UpstreamClient`]) then stay on one thread, where a
/// multi-threaded runtime passes each request between threads several times. Returns a task
/// (on the caller's runtime) that, once `shutdown` resolves, stops every thread as [`serve`]
/// stops and returns the first error any of them met. If that task is dropped, or its runtime
/// ends, the threads stop too.
pub fn serve_on_threads(
    listener: TcpListener,
    app: axum::Router,
    limits: ServeLimits,
    keys: KeyedRoutes,
    hop: Option<Arc<Hop>>,
    threads: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let listener = listener.into_std()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut done = Vec::with_capacity(threads);
    for i in 0..threads.max(1) {
        let l = listener.try_clone()?;
        let app = app.clone();
        let keys = keys.clone();
        let hop = hop.clone();
        let mut stop = stop_rx.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("{IO_THREAD_PREFIX}{i}"))
            .spawn(move || {
                let run = || {
                    // Its blocking threads (where agent turns render and tokenize) carry
                    // the prefix too, so the gateway's CPU counts them.
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .thread_name(format!("{IO_THREAD_PREFIX}{i}-blocking"))
                        .build()?;
                    rt.block_on(async move {
                        let l = TcpListener::from_std(l)?;
                        // Ends when told to, or when the sender is gone (the task below was
                        // dropped): either way the thread stops.
                        let stopped = async move {
                            let _ = stop.wait_for(|s| *s).await;
                        };
                        serve(l, app, limits, keys, hop, stopped).await
                    })
                };
                let _ = tx.send(run());
            })?;
        done.push(rx);
    }
    Ok(tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
        let mut first = Ok(());
        for rx in done {
            let r = rx
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("a gateway I/O thread panicked")));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }))
}

/// Serves one connection until it ends, the server stops, or it stays idle too long.
async fn connection(
    tcp: tokio::net::TcpStream,
    app: axum::Router,
    front: Arc<Front>,
    mut stop: watch::Receiver<bool>,
    _open: watch::Receiver<()>,
) {
    let limits = front.limits;
    let activity = Arc::new(Activity::new());
    let act = activity.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::new(&act);
        let (app, front) = (app.clone(), front.clone());
        async move {
            let resp = crate::envelope::front(&front, app, req).await;
            Ok::<_, Infallible>(resp.map(|b| {
                // The request counts as in flight until its body is sent.
                HeldBody::new(b, busy).into_body()
            }))
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(HYPER_MAX_HEADERS);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection(TokioIo::new(tcp), svc);
    tokio::pin!(conn);
    let mut closing = *stop.borrow();
    if closing {
        conn.as_mut().graceful_shutdown();
    }
    // The idle timer is armed at a lower bound of the deadline and, when it fires, either
    // closes the connection or moves to the deadline as it stands then: `idle_since` only
    // moves forward, and a connection busy now cannot be idle-expired before `now + idle`.
    let first = activity
        .deadline(limits.idle_timeout, limits.header_read_timeout)
        .unwrap_or_else(|| Instant::now() + limits.idle_timeout);
    let idle = tokio::time::sleep_until(first);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                break;
            }
            _ = stop.changed(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            () = idle.as_mut(), if !closing => {
                let now = Instant::now();
                match activity.deadline(limits.idle_timeout, limits.header_read_timeout) {
                    Some(d) if d <= now => {
                        tracing::debug!("closing an idle connection");
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    Some(d) => idle.as_mut().reset(d),
                    None => idle.as_mut().reset(now + limits.idle_timeout),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_bounds_are_refused() {
        let ok = ServeLimits {
            header_read_timeout: Duration::from_secs(1),
            body_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            max_body_bytes: 1,
            max_weights_bytes: 1,
        };
        assert!(ok.check().is_ok());
        let bad = ServeLimits {
            idle_timeout: Duration::ZERO,
            ..ok
        };
        assert!(bad.check().unwrap_err().contains("idle_timeout"));
        let bad = ServeLimits {
            max_body_bytes: 0,
            ..ok
        };
        assert!(bad.check().is_err());
    }

    #[tokio::test]
    async fn in_flight_requests_hold_off_the_idle_deadline() {
        let a = Arc::new(Activity::new());
        let idle = Duration::from_secs(5);
        let first = Duration::from_secs(1);
        let before = a.deadline(idle, first).expect("idle");
        assert!(
            before <= Instant::now() + first,
            "a silent new connection gets the header timeout"
        );
        let b = Busy::new(&a);
        assert_eq!(a.deadline(idle, first), None);
        drop(b);
        let d = a.deadline(idle, first).expect("idle again");
        assert!(
            d > Instant::now() + Duration::from_secs(4),
            "then the idle timeout"
        );
    }
}
