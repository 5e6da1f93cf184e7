//! Framed calls: actor calls as length-prefixed protobuf frames on a plain TCP connection to
//! the host's own port, beside gRPC.
//!
//! Why a second protocol: a call over gRPC's `CallStream` crosses about nine tasks (caller →
//! request-body pipe → HTTP/2 connection → host connection → stream task → actor and back),
//! each a cross-thread wake-up on a multi-threaded runtime, plus HTTP/2 framing. Here the caller
//! writes its frame to the socket itself, one host task reads frames, dispatches them to their
//! actors in arrival order (the same per-caller ordering as `CallStream`) and writes replies, and
//! one client task reads replies: about half the wake-ups. The messages are `troupe.v1`'s own
//! `CallRequest` / `CallReply`, so there is one vocabulary for calls whichever way they travel.
//!
//! The protocol, after TCP connect:
//! 1. client → host: [`MAGIC`], then the token's length (u32 little-endian, 0 = none) and the
//!    token's bytes. The host tells a framed connection from HTTP/2 by these first bytes, so
//!    both share one port (HTTP/2's preface starts `PRI *`).
//! 2. host → client: one `CallReply` frame with `call_id` 0: an empty payload when accepted, an
//!    `Unauthenticated` error when the token is wrong (then the host closes the connection).
//! 3. Then each way, frames: a u32 little-endian length and that many bytes of `CallRequest`
//!    (client → host) or `CallReply` (host → client), replies in completion order.
//!
//! Spawn, stop, describe and watch stay on gRPC; hosts serving TLS accept calls only over gRPC
//! (the framed connection carries no TLS), and say so in `HostDescription.framed_calls`.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, stream::FuturesUnordered};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use troupe_wire::v1::{self, call_reply};

use crate::call_stream::{deadline, reply};
use crate::error::CallError;
use crate::host::HostCore;
use crate::idle_poll::{IdleGaps, Polled, host_poll_for, read_for};

/// The first bytes a framed-call client sends ("TROUPE", protocol version 1, "C").
pub const MAGIC: &[u8; 8] = b"TROUPE\x01C";

/// Longest token a hello may carry; a longer one is refused before it is read.
pub const MAX_TOKEN_BYTES: u32 = 4096;

/// Room for the envelope around a payload (actor id, method, ids) in a frame.
pub const FRAME_OVERHEAD: u64 = 64 << 10;

/// The most [`take_frame`] reserves ahead of bytes that have arrived.
const RESERVE_AHEAD: usize = 4 << 20;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer announced a frame longer than the limit; the connection cannot continue.
    #[error("frame of {size} bytes is over the limit of {limit}")]
    TooLarge {
        /// Announced length.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The bytes are not the expected protobuf message.
    #[error("malformed frame: {0}")]
    Malformed(#[from] prost::DecodeError),
}

/// Appends `m` to `out` as one frame.
pub fn encode_frame(m: &impl Message, out: &mut Vec<u8>) {
    let len = m.encoded_len();
    out.reserve(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    // Encoding into a Vec with the room reserved cannot fail.
    let _ = m.encode(out);
}

/// Takes one whole frame off the front of `buf`, if one is there.
pub fn take_frame<M: Message + Default>(
    buf: &mut BytesMut,
    limit: u64,
) -> Result<Option<M>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as u64;
    if len > limit {
        return Err(FrameError::TooLarge { size: len, limit });
    }
    let len = len as usize;
    if buf.len() < 4 + len {
        // Room for the rest, so the reads that follow fill it without regrowing; at most
        // RESERVE_AHEAD at a time, so a length that is announced but never sent costs nothing.
        buf.reserve((4 + len - buf.len()).min(RESERVE_AHEAD));
        return Ok(None);
    }
    buf.advance(4);
    let frame = buf.split_to(len).freeze();
    Ok(Some(M::decode(frame)?))
}

/// The hello a client sends: [`MAGIC`] and its token.
pub fn hello(token: Option<&str>) -> Vec<u8> {
    let t = token.unwrap_or("").as_bytes();
    let mut out = Vec::with_capacity(12 + t.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(t.len() as u32).to_le_bytes());
    out.extend_from_slice(t);
    out
}

/// What a new connection speaks, by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Framed calls: [`MAGIC`] arrived.
    Framed,
    /// gRPC: HTTP/2's whole connection preface arrived.
    Grpc,
}

/// HTTP/2's connection preface (RFC 9113 §3.4): every HTTP/2 client sends exactly this first.
pub const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads (without consuming) `stream`'s first bytes until they are [`MAGIC`] or the whole
/// [`H2_PREFACE`]: `None` when they are neither, the peer closes, or `deadline` passes
/// first (a client that sends part of either and stops is not waited for).
pub async fn classify(stream: &TcpStream, deadline: tokio::time::Instant) -> Option<Protocol> {
    let mut b = [0u8; H2_PREFACE.len()];
    loop {
        let n = tokio::time::timeout_at(deadline, stream.peek(&mut b))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        let framed = b[..n.min(MAGIC.len())] == MAGIC[..n.min(MAGIC.len())];
        let h2 = b[..n] == H2_PREFACE[..n];
        match (framed, h2) {
            (true, _) if n >= MAGIC.len() => return Some(Protocol::Framed),
            (_, true) if n == H2_PREFACE.len() => return Some(Protocol::Grpc),
            (false, false) => return None,
            _ => {}
        }
        // A prefix arrived alone: readiness stays set until more comes, so wait a little
        // rather than spin on peek.
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Serves one framed connection (its magic not yet consumed) until the caller closes it, a
/// frame is bad, or the host stops. The whole hello must arrive by `by`; `pending` (the
/// connection's place among those not yet authenticated) is given back once it has.
pub async fn serve_connection<P: Send>(
    core: HostCore,
    stream: TcpStream,
    by: tokio::time::Instant,
    pending: P,
) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    if let Err(why) = run(core, stream, by, pending).await {
        tracing::debug!(%peer, "framed call connection closed: {why}");
    }
}

/// Reads the hello (magic, token length, token) by `by`: the token, or `None` when its
/// announced length is over [`MAX_TOKEN_BYTES`] (not read).
async fn read_hello(
    rd: &mut tokio::net::tcp::OwnedReadHalf,
    by: tokio::time::Instant,
) -> Result<Option<Vec<u8>>, String> {
    let read = async {
        let mut head = [0u8; 12];
        rd.read_exact(&mut head).await?;
        let tlen = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if tlen > MAX_TOKEN_BYTES {
            return Ok(None);
        }
        let mut t = vec![0u8; tlen as usize];
        rd.read_exact(&mut t).await?;
        Ok::<_, std::io::Error>(Some(t))
    };
    tokio::time::timeout_at(by, read)
        .await
        .map_err(|_| "the hello did not arrive whole within the handshake timeout".to_string())?
        .map_err(|e| format!("reading the hello: {e}"))
}

async fn run<P>(
    core: HostCore,
    stream: TcpStream,
    by: tokio::time::Instant,
    pending: P,
) -> Result<(), String> {
    let (mut rd, mut wr) = stream.into_split();
    let mut out = Vec::with_capacity(4096);
    let token = read_hello(&mut rd, by).await?;
    let tlen = token.as_ref().map_or(0, Vec::len);
    let accepted = match (&core.config().auth_token, &token) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(want), Some(got)) => crate::auth::same(want.as_bytes(), got),
    };
    if !accepted {
        let why = if token.is_none() {
            "the hello's token is longer than 4096 bytes"
        } else if tlen == 0 {
            "this host requires a control-plane token (set TROUPE_TOKEN)"
        } else {
            "wrong control-plane token: use the host's token (--token, TROUPE_TOKEN or the config's `token`)"
        };
        let e = CallError::Unauthenticated(why.into());
        encode_frame(&reply(0, Err(e)), &mut out);
        let _ = wr.write_all(&out).await;
        return Err(why.into());
    }
    encode_frame(&reply(0, Ok(Vec::new())), &mut out);
    wr.write_all(&out)
        .await
        .map_err(|e| format!("writing the hello's answer: {e}"))?;
    out.clear();
    // Authenticated: no longer one of the connections that have not said who they are.
    drop(pending);

    let limit = core
        .config()
        .max_message_bytes
        .saturating_add(FRAME_OVERHEAD);
    let stop = core.stopped();
    let mut inbox = BytesMut::with_capacity(64 << 10);
    let mut inflight: Inflight = FuturesUnordered::new();
    let window = host_poll_for();
    let mut gaps = IdleGaps::default();
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            Some(r) = inflight.next(), if !inflight.is_empty() => {
                encode_frame(&r, &mut out);
                // Whatever else has finished goes out in the same write.
                while let Some(Some(r)) = inflight.next().now_or_never() {
                    encode_frame(&r, &mut out);
                }
                wr.write_all(&out).await.map_err(|e| format!("writing replies: {e}"))?;
                out.clear();
                if !inflight.is_empty() {
                    continue;
                }
                // Idle: a sequential caller's next call comes a few microseconds after it read
                // this reply. Read for it a moment rather than park (see `idle_poll`).
                gaps.idle();
                if !gaps.poll_now(window) {
                    continue;
                }
                match read_for(rd.as_ref(), &mut inbox, window).await {
                    Polled::Nothing => continue,
                    Polled::Closed => return Ok(()),
                    Polled::Failed(e) => return Err(format!("reading calls: {e}")),
                    Polled::Bytes => {}
                }
                gaps.caught(window);
                take_calls(&core, &mut inbox, limit, &mut inflight, &mut out)?;
                if !out.is_empty() {
                    wr.write_all(&out).await.map_err(|e| format!("writing replies: {e}"))?;
                    out.clear();
                }
            }
            n = rd.read_buf(&mut inbox) => {
                match n {
                    Ok(0) => return Ok(()),
                    Err(e) => return Err(format!("reading calls: {e}")),
                    Ok(_) => {}
                }
                gaps.busy();
                take_calls(&core, &mut inbox, limit, &mut inflight, &mut out)?;
                if !out.is_empty() {
                    wr.write_all(&out).await.map_err(|e| format!("writing replies: {e}"))?;
                    out.clear();
                }
            }
        }
    }
}

/// Calls a connection has dispatched and not yet answered.
type Inflight = FuturesUnordered<BoxFuture<'static, v1::CallReply>>;

/// Dispatches every whole call in `inbox` to its actor (its reply joins `inflight`), or
/// encodes the refusal into `out`. An oversized or malformed frame ends the connection.
fn take_calls(
    core: &HostCore,
    inbox: &mut BytesMut,
    limit: u64,
    inflight: &mut Inflight,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    while let Some(r) = take_frame::<v1::CallRequest>(inbox, limit).map_err(|e| e.to_string())? {
        let id = r.call_id;
        match core.dispatch(&r.actor_id, r.method, r.payload) {
            Ok(rx) => {
                let core = core.clone();
                let d = deadline(r.deadline_ms);
                inflight.push(Box::pin(
                    async move { reply(id, core.await_reply(rx, d).await) },
                ));
            }
            Err(e) => encode_frame(&reply(id, Err(e)), out),
        }
    }
    Ok(())
}

/// A `CallReply`'s result as the caller sees it, whichever way it came (frame or `CallStream`).
pub fn reply_result(r: v1::CallReply) -> Result<Vec<u8>, CallError> {
    match r.result {
        Some(call_reply::Result::Payload(p)) => Ok(p),
        Some(call_reply::Result::Error(e)) => Err(CallError::from_wire(&e)),
        None => Err(CallError::Transport("empty reply".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_whole_and_split_anywhere() {
        let req = v1::CallRequest {
            actor_id: "a".into(),
            method: "m".into(),
            payload: vec![7; 300],
            call_id: 9,
            deadline_ms: 0,
        };
        let mut bytes = Vec::new();
        encode_frame(&req, &mut bytes);
        encode_frame(&req, &mut bytes);
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            let mut got = Vec::new();
            while let Some(m) = take_frame::<v1::CallRequest>(&mut buf, 1 << 20).unwrap() {
                got.push(m);
            }
            buf.extend_from_slice(&bytes[cut..]);
            while let Some(m) = take_frame::<v1::CallRequest>(&mut buf, 1 << 20).unwrap() {
                got.push(m);
            }
            assert_eq!(got, vec![req.clone(), req.clone()], "cut at {cut}");
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn an_oversized_or_malformed_frame_is_an_error_not_an_allocation() {
        let mut buf = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
        assert!(matches!(
            take_frame::<v1::CallRequest>(&mut buf, 1 << 20),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(buf.capacity() < 1 << 20);
        let mut buf = BytesMut::from(&(1u32 << 30).to_le_bytes()[..]);
        assert!(
            take_frame::<v1::CallRequest>(&mut buf, u32::MAX as u64)
                .unwrap()
                .is_none()
        );
        assert!(
            buf.capacity() <= 4 + RESERVE_AHEAD,
            "reserved what was only announced"
        );
        let mut buf = BytesMut::from(&[3, 0, 0, 0, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            take_frame::<v1::CallRequest>(&mut buf, 1 << 20),
            Err(FrameError::Malformed(_))
        ));
    }
}
