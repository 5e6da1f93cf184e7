//! Messages on the control connection between rank 0 and each engine: chain wiring, bucket
//! confirmations, and failure reports naming the rank at fault.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TcpError;
use super::frame::{put_message, put_short_str, read_message, read_short_str};
use super::shm::Offer;

const TOPOLOGY: u8 = 10;
const GROUP_READY: u8 = 11;
const COMMIT: u8 = 12;
const FAILED: u8 = 13;
const SHM_OFFER: u8 = 14;
const REPAIR: u8 = 15;
const CLOSE: u8 = 3;
const READY: u8 = 20;
const ACK: u8 = 21;
const ERROR: u8 = 22;
const MAPPED: u8 = 23;
const ACK_NEED: u8 = 24;
/// Most tensor positions one repair or need list may name.
const MAX_POSITIONS: usize = 1 << 20;

/// Where an engine sits in the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Topology {
    /// Rank that sends this engine its data (0 for the first engine).
    pub pred_rank: u32,
    /// The next engine's first rank and data address, if this engine is not the last.
    pub succ: Option<(u32, String)>,
    /// The engine reads buckets from the shared-memory ring it mapped (its data link from rank
    /// 0 then carries ring positions, not bytes); such engines are not chain members.
    pub shm: bool,
}

/// Rank 0 -> engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToEngine {
    /// Rank 0 runs on this engine's machine: map this ring if you can.
    ShmOffer(Offer),
    Topology(Topology),
    GroupReady,
    Commit,
    /// These tensors of the bucket follow again, whole (some engine could not apply their
    /// deltas).
    Repair(Vec<u32>),
    Failed {
        rank: u32,
        reason: String,
    },
    Close,
}

/// Whose fault an engine's error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The engine itself refused (mismatched bucket, bad data).
    Mine,
    /// Its predecessor's link broke or stalled.
    Upstream,
    /// Its successor's link broke.
    Downstream,
}

/// Engine -> rank 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FromEngine {
    /// Answer to a [`ToEngine::ShmOffer`]: `None` mapped, `Some(why not)` stays on TCP.
    Mapped(Option<String>),
    Ready,
    Ack,
    /// The bucket arrived, but the deltas of these tensors could not be applied.
    AckNeed(Vec<u32>),
    Error {
        fault: Fault,
        rank: u32,
        reason: String,
    },
}

pub(crate) async fn write_to_engine<S: AsyncWrite + Unpin>(
    s: &mut S,
    msg: &ToEngine,
) -> Result<(), TcpError> {
    let mut buf = Vec::with_capacity(32);
    match msg {
        ToEngine::Topology(t) => {
            buf.push(TOPOLOGY);
            buf.extend_from_slice(&t.pred_rank.to_le_bytes());
            match &t.succ {
                Some((rank, addr)) => {
                    buf.push(1);
                    buf.extend_from_slice(&rank.to_le_bytes());
                    put_short_str(&mut buf, addr)?;
                }
                None => buf.push(0),
            }
            buf.push(u8::from(t.shm));
        }
        ToEngine::ShmOffer(o) => {
            buf.push(SHM_OFFER);
            put_short_str(&mut buf, &o.path)?;
            buf.extend_from_slice(&o.nonce);
            buf.extend_from_slice(&o.ring.to_le_bytes());
        }
        ToEngine::GroupReady => buf.push(GROUP_READY),
        ToEngine::Commit => buf.push(COMMIT),
        ToEngine::Repair(list) => {
            buf.push(REPAIR);
            put_positions(&mut buf, list);
        }
        ToEngine::Failed { rank, reason } => {
            buf.push(FAILED);
            buf.extend_from_slice(&rank.to_le_bytes());
            put_message(&mut buf, reason);
        }
        ToEngine::Close => buf.push(CLOSE),
    }
    s.write_all(&buf).await?;
    Ok(())
}

/// Reads the rest of a rank-0 message whose kind byte was already read (so the kind can be
/// awaited in a `select!` without losing bytes).
pub(crate) async fn read_to_engine_rest<S: AsyncRead + Unpin>(
    s: &mut S,
    kind: u8,
) -> Result<ToEngine, TcpError> {
    Ok(match kind {
        TOPOLOGY => {
            let pred_rank = s.read_u32_le().await?;
            let succ = match s.read_u8().await? {
                0 => None,
                1 => {
                    let rank = s.read_u32_le().await?;
                    Some((rank, read_short_str(s, "successor address").await?))
                }
                b => return Err(TcpError::Protocol(format!("topology successor flag {b}"))),
            };
            let shm = match s.read_u8().await? {
                0 => false,
                1 => true,
                b => return Err(TcpError::Protocol(format!("topology shm flag {b}"))),
            };
            ToEngine::Topology(Topology {
                pred_rank,
                succ,
                shm,
            })
        }
        SHM_OFFER => {
            let path = read_short_str(s, "ring path").await?;
            let mut nonce = [0u8; 16];
            s.read_exact(&mut nonce).await?;
            let ring = s.read_u64_le().await?;
            ToEngine::ShmOffer(Offer { path, nonce, ring })
        }
        GROUP_READY => ToEngine::GroupReady,
        COMMIT => ToEngine::Commit,
        REPAIR => ToEngine::Repair(read_positions(s).await?),
        FAILED => {
            let rank = s.read_u32_le().await?;
            ToEngine::Failed {
                rank,
                reason: read_message(s).await?,
            }
        }
        CLOSE => ToEngine::Close,
        other => {
            return Err(TcpError::Protocol(format!(
                "unknown control message {other} from rank 0"
            )));
        }
    })
}

/// The error for a rank-0 message that is not the one an engine waits for.
pub(crate) fn unexpected(m: ToEngine, waiting_for: &str) -> TcpError {
    match m {
        ToEngine::Close => TcpError::Rejected("sender closed the group".into()),
        other => TcpError::Protocol(format!(
            "rank 0 sent {other:?} while this engine waited for {waiting_for}"
        )),
    }
}

pub(crate) async fn read_to_engine<S: AsyncRead + Unpin>(s: &mut S) -> Result<ToEngine, TcpError> {
    let kind = s.read_u8().await?;
    read_to_engine_rest(s, kind).await
}

pub(crate) async fn write_from_engine<S: AsyncWrite + Unpin>(
    s: &mut S,
    msg: &FromEngine,
) -> Result<(), TcpError> {
    let mut buf = Vec::with_capacity(16);
    match msg {
        FromEngine::Mapped(why_not) => {
            buf.push(MAPPED);
            match why_not {
                None => buf.push(0),
                Some(reason) => {
                    buf.push(1);
                    put_message(&mut buf, reason);
                }
            }
        }
        FromEngine::Ready => buf.push(READY),
        FromEngine::Ack => buf.push(ACK),
        FromEngine::AckNeed(list) => {
            buf.push(ACK_NEED);
            put_positions(&mut buf, list);
        }
        FromEngine::Error {
            fault,
            rank,
            reason,
        } => {
            buf.push(ERROR);
            buf.push(match fault {
                Fault::Mine => 0,
                Fault::Upstream => 1,
                Fault::Downstream => 2,
            });
            buf.extend_from_slice(&rank.to_le_bytes());
            put_message(&mut buf, reason);
        }
    }
    s.write_all(&buf).await?;
    Ok(())
}

pub(crate) async fn read_from_engine<S: AsyncRead + Unpin>(
    s: &mut S,
) -> Result<FromEngine, TcpError> {
    Ok(match s.read_u8().await? {
        MAPPED => FromEngine::Mapped(match s.read_u8().await? {
            0 => None,
            1 => Some(read_message(s).await?),
            b => return Err(TcpError::Protocol(format!("mapped flag {b}"))),
        }),
        READY => FromEngine::Ready,
        ACK => FromEngine::Ack,
        ACK_NEED => FromEngine::AckNeed(read_positions(s).await?),
        ERROR => {
            let fault = match s.read_u8().await? {
                0 => Fault::Mine,
                1 => Fault::Upstream,
                2 => Fault::Downstream,
                b => return Err(TcpError::Protocol(format!("error fault byte {b}"))),
            };
            let rank = s.read_u32_le().await?;
            FromEngine::Error {
                fault,
                rank,
                reason: read_message(s).await?,
            }
        }
        other => {
            return Err(TcpError::Protocol(format!(
                "unknown control message {other} from an engine"
            )));
        }
    })
}

fn put_positions(buf: &mut Vec<u8>, list: &[u32]) {
    buf.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for p in list {
        buf.extend_from_slice(&p.to_le_bytes());
    }
}

async fn read_positions<S: AsyncRead + Unpin>(s: &mut S) -> Result<Vec<u32>, TcpError> {
    let n = s.read_u32_le().await? as usize;
    if n > MAX_POSITIONS {
        return Err(TcpError::Protocol(format!(
            "a list of {n} tensor positions"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(s.read_u32_le().await?);
    }
    Ok(out)
}
