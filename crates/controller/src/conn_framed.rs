//! The controller's side of framed calls ([`troupe_actors::framed`]): the caller appends its
//! frame to the connection's outbox and writes it to the socket itself, so sending a call wakes
//! no task; one task per connection reads replies (and finishes a write the socket could not
//! take at once).

use std::io;
use std::sync::Arc;
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
use troupe_wire::v1;

/// An outbox larger than this is given back once it has drained (a large call's frame should
/// not pin its size for the connection's life).
const KEEP_OUTBOX: usize = 1 << 20;

/// The sending side of one framed connection.
pub(crate) struct FramedWriter {
    half: OwnedWriteHalf,
    out: Mutex<Outbox>,
    /// Wakes the connection's task when it is to finish a write (the socket could not take a
    /// whole one, or the caller left it to gather more frames).
    stalled: Notify,
    /// Cancelled when the connection is closed: its task stops reading and drops the socket.
    gone: CancellationToken,
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

impl FramedWriter {
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
}

/// Connects to a host's port, says hello with `token` and waits for the host to accept.
pub(crate) async fn connect(
    addr: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<(OwnedReadHalf, Arc<FramedWriter>), CallError> {
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
        Ok((
            rd,
            Arc::new(FramedWriter {
                half: wr,
                out: Mutex::new(Outbox::default()),
                stalled: Notify::new(),
                gone: CancellationToken::new(),
            }),
        ))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| bad(format!("no answer to the hello within {timeout:?}")))?
}

/// Reads replies and hands each to `deliver` until the connection ends; finishes writes the
/// socket could not take at once. Returns why it ended. Dropping the future closes nothing
/// by itself: [`close`] ends it.
pub(crate) async fn drive(
    mut rd: OwnedReadHalf,
    w: &FramedWriter,
    mut deliver: impl FnMut(v1::CallReply) -> bool,
) -> String {
    let mut inbox = BytesMut::with_capacity(64 << 10);
    let mut writing = false;
    loop {
        tokio::select! {
            biased;
            _ = w.gone.cancelled() => {
                return w.out.lock().closed.clone().unwrap_or_else(|| "closed".into());
            }
            n = rd.read_buf(&mut inbox) => {
                match n {
                    Ok(0) => return "call connection closed by the host".into(),
                    Err(e) => return format!("call connection failed: {e}"),
                    Ok(_) => {}
                }
                loop {
                    // Replies are as large as the host lets payloads be; the host is trusted
                    // with their size as gRPC's client was.
                    match take_frame::<v1::CallReply>(&mut inbox, u32::MAX as u64) {
                        Ok(Some(r)) => {
                            if !deliver(r) {
                                return "the controller's connection is gone".into();
                            }
                        }
                        Ok(None) => break,
                        Err(e) => return format!("call connection: {e}"),
                    }
                }
            }
            _ = w.stalled.notified(), if !writing => writing = true,
            r = w.half.writable(), if writing => {
                if let Err(e) = r {
                    return format!("call connection failed: {e}");
                }
                let mut o = w.out.lock();
                if let Some(why) = &o.closed {
                    return why.clone();
                }
                o.stalled = false;
                w.write_now(&mut o);
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
pub(crate) fn close(w: &FramedWriter, why: &str) {
    {
        let mut o = w.out.lock();
        if o.closed.is_none() {
            o.closed = Some(why.to_string());
        }
    }
    w.gone.cancel();
}
