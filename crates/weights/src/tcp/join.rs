//! The join handshake on a control connection: rank 0 challenges, the engine answers with its
//! ranks, group, data address and bases digest, tagged with the group secret; rank 0 admits it
//! with a tag of its own, so each side knows the other holds the secret (which never crosses
//! the wire).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::auth::{GroupSecret, NONCE_BYTES, Purpose, TAG_BYTES, nonce};
use super::frame::{put_short_str, read_short_str, read_status, write_status};
use super::{MAGIC, TcpError, VERSION};

/// Longest a single connection may take to complete its join before it is dropped (each is
/// read on its own, so a silent one holds up nobody else).
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest rank 0 waits to write a verdict to a peer that does not read it.
const VERDICT_WRITE: Duration = Duration::from_secs(1);

/// A receiver's handshake, once its tag checked out.
#[derive(Debug)]
pub(super) struct Hello {
    pub rank: u32,
    pub n_ranks: u32,
    pub group: String,
    pub data_addr: String,
    /// Digest of the delta bases the engine holds.
    pub digest: u64,
}

/// A connection whose join proved the secret, waiting for rank 0's verdict on its ranks.
#[derive(Debug)]
pub(super) struct Joined {
    pub stream: TcpStream,
    pub from: SocketAddr,
    /// The connection comes from this machine's own address (so it may map the ring).
    pub local: bool,
    pub hello: Hello,
    /// What rank 0 answers with when it admits the engine.
    admit_tag: [u8; TAG_BYTES],
}

impl Joined {
    /// Admits the engine (it checks rank 0's tag).
    pub(super) async fn admit(&mut self) -> Result<(), TcpError> {
        let mut reply = vec![0u8];
        reply.extend_from_slice(&self.admit_tag);
        tokio::time::timeout(VERDICT_WRITE, self.stream.write_all(&reply))
            .await
            .map_err(|_| TcpError::Timeout("the engine does not read its admission".into()))??;
        Ok(())
    }

    /// Refuses the engine, saying why.
    pub(super) async fn refuse(mut self, reason: &str) {
        tracing::warn!(from = %self.from, %reason, "rejecting weight receiver");
        let _ =
            tokio::time::timeout(VERDICT_WRITE, write_status(&mut self.stream, Err(reason))).await;
    }
}

/// Rank 0's side of one connection: challenges it and checks its join by `by`. A connection
/// that does not prove the secret (or says something malformed, or nothing in time) is told
/// why and dropped: `None`.
pub(super) async fn shake(
    mut stream: TcpStream,
    from: SocketAddr,
    by: Instant,
    secret: Arc<GroupSecret>,
) -> Option<Joined> {
    let _ = stream.set_nodelay(true);
    let local = match (stream.local_addr(), stream.peer_addr()) {
        (Ok(me), Ok(them)) => me.ip() == them.ip(),
        _ => false,
    };
    let reason = match tokio::time::timeout_at(by, read_join(&mut stream, &secret)).await {
        Ok(Ok((hello, admit_tag))) => {
            return Some(Joined {
                stream,
                from,
                local,
                hello,
                admit_tag,
            });
        }
        Ok(Err(TcpError::Rejected(m))) => m,
        Ok(Err(e)) => format!("bad handshake: {e}"),
        Err(_) => format!("no complete handshake within {} s", HELLO_TIMEOUT.as_secs()),
    };
    tracing::warn!(%from, %reason, "rejecting weight receiver");
    let _ = tokio::time::timeout(VERDICT_WRITE, write_status(&mut stream, Err(&reason))).await;
    None
}

/// Reads a join: magic and version, then (after sending the challenge) the fields and their
/// tag. Returns the hello and the tag rank 0 admits it with.
async fn read_join(
    stream: &mut TcpStream,
    secret: &GroupSecret,
) -> Result<(Hello, [u8; TAG_BYTES]), TcpError> {
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(TcpError::Protocol(format!(
            "magic {magic:?} is not {MAGIC:?}: this port is a troupe weight sender, connect \
             with troupe_weights::tcp::WeightReceiver"
        )));
    }
    let version = stream.read_u16_le().await?;
    if version != VERSION {
        return Err(TcpError::Protocol(format!(
            "handshake version {version}, this sender speaks {VERSION}; run the same troupe \
             version on trainer and engines"
        )));
    }
    let challenge = nonce()?;
    let mut ask = vec![0u8];
    ask.extend_from_slice(&challenge);
    stream.write_all(&ask).await?;
    let rank = stream.read_u32_le().await?;
    let n_ranks = stream.read_u32_le().await?;
    let group = read_short_str(stream, "group name").await?;
    let data_addr = read_short_str(stream, "data address").await?;
    let digest = stream.read_u64_le().await?;
    let mut engine_nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut engine_nonce).await?;
    let mut tag = [0u8; TAG_BYTES];
    stream.read_exact(&mut tag).await?;
    let body = join_body(rank, n_ranks, &group, &data_addr, digest)?;
    if !secret.verify(Purpose::Join, &[&challenge, &body, &engine_nonce], &tag) {
        return Err(TcpError::Rejected(format!(
            "the join for ranks {rank}.. does not prove this group's secret: pass the \
             group_secret rank 0's WeightSender::secret() gives (the init call carries it)"
        )));
    }
    if data_addr.parse::<SocketAddr>().is_err() {
        return Err(TcpError::Protocol(format!(
            "data address {data_addr:?} is not ip:port"
        )));
    }
    let admit_tag = secret.tag(Purpose::Admit, &[&engine_nonce, &challenge]);
    Ok((
        Hello {
            rank,
            n_ranks,
            group,
            data_addr,
            digest,
        },
        admit_tag,
    ))
}

/// The join's fields as they are sent and tagged.
fn join_body(
    rank: u32,
    n_ranks: u32,
    group: &str,
    data_addr: &str,
    digest: u64,
) -> Result<Vec<u8>, TcpError> {
    let mut b = Vec::with_capacity(24 + group.len() + data_addr.len());
    b.extend_from_slice(&rank.to_le_bytes());
    b.extend_from_slice(&n_ranks.to_le_bytes());
    put_short_str(&mut b, group)?;
    put_short_str(&mut b, data_addr)?;
    b.extend_from_slice(&digest.to_le_bytes());
    Ok(b)
}

/// An engine's side: joins over `control` as `hello` says, proving `secret`, and checks that
/// rank 0 proves it too. Errors: [`TcpError::Rejected`] with rank 0's reason, or naming a rank 0
/// that does not hold the secret.
pub(super) async fn send_join(
    control: &mut TcpStream,
    secret: &GroupSecret,
    hello: &Hello,
    addr: &str,
) -> Result<(), TcpError> {
    let mut start = Vec::with_capacity(6);
    start.extend_from_slice(MAGIC);
    start.extend_from_slice(&VERSION.to_le_bytes());
    control.write_all(&start).await?;
    read_status(control).await?.map_err(TcpError::Rejected)?;
    let mut challenge = [0u8; NONCE_BYTES];
    control.read_exact(&mut challenge).await?;
    let engine_nonce = nonce()?;
    let mut body = join_body(
        hello.rank,
        hello.n_ranks,
        &hello.group,
        &hello.data_addr,
        hello.digest,
    )?;
    let tag = secret.tag(Purpose::Join, &[&challenge, &body, &engine_nonce]);
    body.extend_from_slice(&engine_nonce);
    body.extend_from_slice(&tag);
    control.write_all(&body).await?;
    read_status(control).await?.map_err(TcpError::Rejected)?;
    let mut admit = [0u8; TAG_BYTES];
    control.read_exact(&mut admit).await?;
    if !secret.verify(Purpose::Admit, &[&engine_nonce, &challenge], &admit) {
        return Err(TcpError::Rejected(format!(
            "the weight sender at {addr} admitted rank {} without proving the group secret: \
             it is not this group's rank 0",
            hello.rank
        )));
    }
    Ok(())
}
