//! The controller's side of framed calls ([`troupe_actors::framed`]): the caller appends its
//! frame to the connection's outbox and writes it to the socket itself, so sending a call wakes
//! no task; one task per connection reads replies (and finishes a write the socket could not
//! take at once).
//!
//! A lone call whose replies have lately come back quickly does not wait for that task: it reads
//! the socket itself for up to [`POLL_FOR`] ([`FramedConn::poll_replies`]; `TROUPE_CALL_POLL_US`
//! sets the window, 0 turns it off), as NCCL's proxies and kernel busy-polling do. Waiting the
//! ordinary way parks the worker thread, and on a virtual machine an idle vCPU takes tens of
//! microseconds to wake: on 2 vCPUs a sequential call's round trip was 53-68 µs when both sides
//! parked and is 24-27 µs polling. Between reads the call yields to the runtime rather than
//! spinning inside its poll (or yielding the thread): `troupe bench rpc` on a 2-vCPU VM went from
//! a median of 1.72× the socket's floor, with runs at 13-40 µs, to 1.43× in 22 runs of 23.

use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use troupe_actors::CallError;
use troupe_actors::framed::{self, encode_frame, take_frame};
use troupe_actors::idle_poll::window_from_env;
use troupe_wire::v1;

/// An outbox larger than this is given back once it has drained (a large call's frame should
/// not pin its size for the connection's life).
const KEEP_OUTBOX: usize = 1 << 20;

/// Longest a lone call reads the socket for its own reply before it waits the ordinary way; and
/// the recent round trip (a moving average) above which it does not try at all, so calls that
/// take longer (an actor that computes) never spin. `TROUPE_CALL_POLL_US` overrides it (0: never
/// poll, as on a machine whose cores are all needed by others).
pub(crate) const POLL_FOR: Duration = Duration::from_micros(250);

/// The environment variable that sets [`poll_for`].
const POLL_ENV: &str = "TROUPE_CALL_POLL_US";

/// The polling window: [`POLL_FOR`], or `TROUPE_CALL_POLL_US` read once. A bad value is named
/// in a warning and the default is kept.
pub(crate) fn poll_for() -> Duration {
    static WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| window_from_env(POLL_ENV, POLL_FOR, "polling for call replies"))
}

/// Bytes read per `recv` while polling.
const POLL_CHUNK: usize = 16 << 10;

/// One framed connection: both halves, the replies read so far, the outbox.
pub(crate) struct FramedConn {
    read: OwnedReadHalf,
    /// Bytes of replies not yet whole, and a scratch buffer for polling reads; shared by the
    /// connection's task and a polling caller (whoever holds it reads).
    inbox: Mutex<Inbox>,
    /// Lone calls' recent round trips (see [`POLL_FOR`]).
    pub round_trips: RoundTrips,
    half: OwnedWriteHalf,
    out: Mutex<Outbox>,
    /// Wakes the connection's task when it is to finish a write (the socket could not take a
    /// whole one, or the caller left it to gather more frames).
    stalled: Notify,
    /// Cancelled when the connection is closed: its task stops reading and drops the socket.
    gone: CancellationToken,
}

struct Inbox {
    buf: BytesMut,
    scratch: Vec<u8>,
}

#[derive(Default)]
struct Outbox {
    buf: Vec<u8>,
    /// How much of `buf` is written.
    at: usize,
    /// The connection's task owns the rest of the write.
    stalled: bool,
    /// Why the connection cannot send any more.
    closed: Option<String>,
}

/// A moving average of lone calls' round trips (weight 1/8): whether polling for the next
/// reply is likely to pay.
#[derive(Debug, Default)]
pub(crate) struct RoundTrips(AtomicU64);

impl RoundTrips {
    /// Whether a lone call sent now should read its reply itself for up to `window`: recent
    /// round trips averaged at most that (or none was measured yet).
    pub fn worth_polling(&self, window: Duration) -> bool {
        !window.is_zero() && self.0.load(Ordering::Relaxed) <= window.as_nanos() as u64
    }

    /// Adds a lone call's round trip.
    pub fn record(&self, took: Duration) {
        let sample = took.as_nanos().min(u64::MAX as u128) as u64;
        let old = self.0.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.0.store(new, Ordering::Relaxed);
    }
}

impl FramedConn {
    /// Sends `req` in order after every earlier call; `false` once the connection is closed.
    ///
    /// A lone call (`alone`: no other call in flight) is written by the caller at once, which
    /// is the whole point for sequential calls. With others in flight the frame is left for the
    /// connection's task, which writes whatever has gathered by the time it runs in one
    /// syscall: pipelined callers would otherwise pay a syscall per call.
    pub fn send(&self, req: &v1::CallRequest, alone: bool) -> bool {
        let mut o = self.out.lock();
        if o.closed.is_some() {
            return false;
        }
        encode_frame(req, &mut o.buf);
        if !o.stalled {
            if alone {
                self.write_now(&mut o);
            } else {
                o.stalled = true;
                self.stalled.notify_one();
            }
        }
        true
    }

    /// Whether the connection can still send.
    pub fn is_closed(&self) -> bool {
        self.out.lock().closed.is_some()
    }

    /// Writes what the socket takes without waiting; hands the rest to the connection's task.
    fn write_now(&self, o: &mut Outbox) {
        while o.at < o.buf.len() {
            match self.half.try_write(&o.buf[o.at..]) {
                Ok(0) => {
                    o.closed = Some("the host's socket takes no more bytes".into());
                    break;
                }
                Ok(n) => o.at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    o.closed = Some(format!("writing calls: {e}"));
                    break;
                }
            }
        }
        if o.at == o.buf.len() {
            o.buf.clear();
            o.at = 0;
            if o.buf.capacity() > KEEP_OUTBOX {
                o.buf = Vec::new();
            }
            o.stalled = false;
        } else if !o.stalled || o.closed.is_some() {
            o.stalled = o.closed.is_none();
            self.stalled.notify_one();
        }
    }

    /// Reads whatever replies have arrived and hands each to `deliver`, without waiting and
    /// without the runtime (which learns of arrived bytes only when a worker next polls for
    /// I/O). Does nothing while the connection's task is reading, and leaves the end of the
    /// connection and read errors to that task; a reply it cannot decode closes the connection
    /// (the task would not see those bytes again).
    pub fn poll_replies(&self, deliver: &mut impl FnMut(v1::CallReply) -> bool) {
        let Some(mut inbox) = self.inbox.try_lock() else {
            return;
        };
        let Inbox { buf, scratch } = &mut *inbox;
        if scratch.is_empty() {
            scratch.resize(POLL_CHUNK, 0);
        }
        let sock = socket2::SockRef::from(self.read.as_ref());
        loop {
            // The socket is non-blocking (the runtime made it so): an empty one says WouldBlock.
            match (&*sock).read(scratch) {
                Ok(0) => return,
                Ok(n) => {
                    buf.extend_from_slice(&scratch[..n]);
                    if let Err(why) = take_replies(buf, deliver) {
                        close(self, &why);
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }
}

/// Hands every whole reply in `buf` to `deliver`; why the connection cannot go on, if it cannot.
fn take_replies(
    buf: &mut BytesMut,
    deliver: &mut impl FnMut(v1::CallReply) -> bool,
) -> Result<(), String> {
    loop {
        // Replies are as large as the host lets payloads be; the host is trusted with their
        // size as gRPC's client was.
        match take_frame::<v1::CallReply>(buf, u32::MAX as u64) {
            Ok(Some(r)) => {
                if !deliver(r) {
                    return Err("the controller's connection is gone".into());
                }
            }
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("call connection: {e}")),
        }
    }
}

/// Connects to a host's port, says hello with `token` and waits for the host to accept.
pub(crate) async fn connect(
    addr: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<Arc<FramedConn>, CallError> {
    let bad = |m: String| CallError::Transport(format!("framed calls to {addr}: {m}"));
    let fut = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| bad(e.to_string()))?;
        s.set_nodelay(true).map_err(|e| bad(e.to_string()))?;
        s.write_all(&framed::hello(token))
            .await
            .map_err(|e| bad(e.to_string()))?;
        let mut inbox = BytesMut::with_capacity(256);
        let answer = loop {
            if let Some(r) = take_frame::<v1::CallReply>(&mut inbox, framed::FRAME_OVERHEAD)
                .map_err(|e| bad(e.to_string()))?
            {
                break r;
            }
            if s.read_buf(&mut inbox)
                .await
                .map_err(|e| bad(e.to_string()))?
                == 0
            {
                return Err(bad("the host closed the connection after the hello".into()));
            }
        };
        framed::reply_result(answer)?;
        let (rd, wr) = s.into_split();
        Ok(Arc::new(FramedConn {
            read: rd,
            inbox: Mutex::new(Inbox {
                buf: inbox,
                scratch: Vec::new(),
            }),
            round_trips: RoundTrips::default(),
            half: wr,
            out: Mutex::new(Outbox::default()),
            stalled: Notify::new(),
            gone: CancellationToken::new(),
        }))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| bad(format!("no answer to the hello within {timeout:?}")))?
}

/// Reads replies and hands each to `deliver` until the connection ends; finishes writes the
/// socket could not take at once. Returns why it ended. Dropping the future closes nothing
/// by itself: [`close`] ends it.
pub(crate) async fn drive(
    c: &FramedConn,
    mut deliver: impl FnMut(v1::CallReply) -> bool,
) -> String {
    let mut writing = false;
    loop {
        tokio::select! {
            biased;
            _ = c.gone.cancelled() => {
                return c.out.lock().closed.clone().unwrap_or_else(|| "closed".into());
            }
            r = c.read.readable() => {
                if let Err(e) = r {
                    return format!("call connection failed: {e}");
                }
                let mut inbox = c.inbox.lock();
                loop {
                    inbox.buf.reserve(4096);
                    // Through the runtime, so that WouldBlock clears its readiness (a polling
                    // caller may have taken the bytes the readiness was about).
                    match c.read.try_read_buf(&mut inbox.buf) {
                        Ok(0) => return "call connection closed by the host".into(),
                        Ok(_) => {
                            if let Err(why) = take_replies(&mut inbox.buf, &mut deliver) {
                                return why;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return format!("call connection failed: {e}"),
                    }
                }
            }
            _ = c.stalled.notified(), if !writing => writing = true,
            r = c.half.writable(), if writing => {
                if let Err(e) = r {
                    return format!("call connection failed: {e}");
                }
                let mut o = c.out.lock();
                if let Some(why) = &o.closed {
                    return why.clone();
                }
                o.stalled = false;
                c.write_now(&mut o);
                writing = o.stalled;
                if let Some(why) = &o.closed {
                    return why.clone();
                }
            }
        }
    }
}

/// Closes the connection: later sends fail (and go on a new session), its task ends and
/// drops the socket, so the host sees the controller leave.
pub(crate) fn close(w: &FramedConn, why: &str) {
    {
        let mut o = w.out.lock();
        if o.closed.is_none() {
            o.closed = Some(why.to_string());
        }
    }
    w.gone.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::net::TcpListener;
    use troupe_wire::v1::call_reply;

    fn ok(call_id: u64, payload: &[u8]) -> v1::CallReply {
        v1::CallReply {
            call_id,
            result: Some(call_reply::Result::Payload(payload.to_vec())),
        }
    }

    /// `replies` as the bytes of their frames.
    fn frames(replies: &[v1::CallReply]) -> Vec<u8> {
        let mut out = Vec::new();
        for r in replies {
            encode_frame(r, &mut out);
        }
        out
    }

    /// A host that accepts the hello, then answers each request frame with the bytes `answers`
    /// gives for its call id, in one write.
    async fn fake_host(answers: fn(u64) -> Vec<u8>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut hello = [0u8; 12];
            s.read_exact(&mut hello).await.unwrap();
            let mut out = Vec::new();
            encode_frame(&ok(0, b""), &mut out);
            s.write_all(&out).await.unwrap();
            let mut inbox = BytesMut::new();
            loop {
                while let Some(r) = take_frame::<v1::CallRequest>(&mut inbox, 1 << 20).unwrap() {
                    s.write_all(&answers(r.call_id)).await.unwrap();
                }
                if s.read_buf(&mut inbox).await.unwrap_or(0) == 0 {
                    return;
                }
            }
        });
        addr
    }

    fn request(call_id: u64) -> v1::CallRequest {
        v1::CallRequest {
            actor_id: "a".into(),
            method: "m".into(),
            payload: vec![1, 2, 3],
            call_id,
            deadline_ms: 0,
        }
    }

    #[test]
    fn polling_stops_paying_once_round_trips_are_long_and_resumes_when_short() {
        let rt = RoundTrips::default();
        assert!(rt.worth_polling(POLL_FOR), "nothing measured yet");
        rt.record(Duration::from_micros(30));
        assert!(rt.worth_polling(POLL_FOR));
        assert!(!rt.worth_polling(Duration::ZERO), "0 turns polling off");
        // One slow call (an actor that computes) is enough to stop spinning...
        rt.record(Duration::from_millis(5));
        assert!(!rt.worth_polling(POLL_FOR));
        // ...and a run of quick ones brings it back.
        for _ in 0..40 {
            rt.record(Duration::from_micros(30));
        }
        assert!(rt.worth_polling(POLL_FOR));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reply_that_cannot_be_decoded_while_polling_closes_the_connection() {
        let within = Duration::from_secs(20);
        tokio::time::timeout(within, async {
            // A 3-byte frame that is no CallReply.
            let addr = fake_host(|_| vec![3, 0, 0, 0, 0xff, 0xff, 0xff]).await;
            let c = connect(&addr, None, Duration::from_secs(5)).await.unwrap();
            assert!(c.send(&request(1), true));
            let deadline = Instant::now() + within;
            while !c.is_closed() && Instant::now() < deadline {
                c.poll_replies(&mut |_| true);
                tokio::task::yield_now().await;
            }
            assert!(
                c.is_closed(),
                "a bad reply must end the connection, not leave it hanging"
            );
            assert!(!c.send(&request(2), true));
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_polling_caller_reads_replies_without_the_connection_task() {
        let within = Duration::from_secs(20);
        tokio::time::timeout(within, async {
            // Two replies per request, the second for a call the caller is not waiting on.
            let addr = fake_host(|id| frames(&[ok(id, b"mine"), ok(id + 100, b"other")])).await;
            let c = connect(&addr, None, Duration::from_secs(5)).await.unwrap();
            assert!(c.send(&request(1), true));
            // No task drives the connection: only polling can see the replies.
            let mut got = Vec::new();
            let deadline = Instant::now() + within;
            while got.len() < 2 && Instant::now() < deadline {
                c.poll_replies(&mut |r: v1::CallReply| {
                    got.push(r.call_id);
                    true
                });
                std::hint::spin_loop();
            }
            assert_eq!(got, vec![1, 101]);

            // The connection's task takes over for what comes next, although polling read
            // the bytes its readiness was raised for.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let driver = c.clone();
            let task =
                tokio::spawn(
                    async move { drive(&driver, move |r| tx.send(r.call_id).is_ok()).await },
                );
            assert!(c.send(&request(2), true));
            assert_eq!(rx.recv().await, Some(2));
            assert_eq!(rx.recv().await, Some(102));
            close(&c, "test over");
            assert_eq!(task.await.unwrap(), "test over");
        })
        .await
        .expect("test timed out");
    }
}
