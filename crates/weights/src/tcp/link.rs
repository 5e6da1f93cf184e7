//! Data links of the chain: a predecessor connects to its successor's listener, names the two
//! ranks, and answers the successor's challenge with a tag keyed by the group secret, so a
//! stray connection (an old group, a port scanner, a stranger) is told apart from the real
//! predecessor without the secret crossing the wire.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::auth::{GroupSecret, NONCE_BYTES, Purpose, TAG_BYTES, nonce};
use super::frame::{read_status, write_status};
use super::pending::Handshakes;
use super::{DATA_MAGIC, TcpError, VERSION};

/// Longest one incoming data link may take to complete its hello; each is read on its own, so
/// a silent stranger holds up neither the real predecessor nor the deadline.
const LINK_HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects from rank `from` to rank `to`'s data address and performs the data hello.
pub(crate) async fn connect_link(
    addr: &str,
    secret: &GroupSecret,
    from: u32,
    to: u32,
    deadline: Instant,
) -> Result<TcpStream, TcpError> {
    let work = async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let mut hello = Vec::with_capacity(14);
        hello.extend_from_slice(DATA_MAGIC);
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&from.to_le_bytes());
        hello.extend_from_slice(&to.to_le_bytes());
        s.write_all(&hello).await?;
        read_status(&mut s).await?.map_err(TcpError::Rejected)?;
        let mut challenge = [0u8; NONCE_BYTES];
        s.read_exact(&mut challenge).await?;
        let tag = secret.tag(
            Purpose::Link,
            &[&challenge, &from.to_le_bytes(), &to.to_le_bytes()],
        );
        s.write_all(&tag).await?;
        match read_status(&mut s).await? {
            Ok(()) => Ok(s),
            Err(reason) => Err(TcpError::Rejected(reason)),
        }
    };
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r.map_err(|e| match e {
            TcpError::Rejected(m) => {
                TcpError::Rejected(format!("rank {to} at {addr} refused the data link: {m}"))
            }
            other => TcpError::Protocol(format!(
                "data link from rank {from} to rank {to} at {addr} failed: {other}"
            )),
        }),
        Err(_) => Err(TcpError::Timeout(format!(
            "data link from rank {from} to rank {to} at {addr} was not established in time"
        ))),
    }
}

/// Accepts connections on `listener` until one is the data link from rank `from` to rank `to`
/// proving `secret`; strangers get a rejection naming what was wrong and the wait goes on.
/// Every connection's hello is read in its own task, so one that says nothing delays nobody.
pub(crate) async fn accept_link(
    listener: &TcpListener,
    secret: Arc<GroupSecret>,
    from: u32,
    to: u32,
    deadline: Instant,
) -> Result<TcpStream, TcpError> {
    let mut pending = Handshakes::new(LINK_HELLO_TIMEOUT);
    let shake = move |s: TcpStream, peer: SocketAddr, by: Instant| {
        let secret = secret.clone();
        async move { shake_link(s, peer, by, &secret, from, to).await }
    };
    match pending.next(listener, deadline, shake).await {
        Some(s) => Ok(s),
        None => Err(TcpError::Timeout(format!(
            "rank {from} never opened its data link to rank {to}"
        ))),
    }
}

/// One incoming connection: the link if it is the right predecessor's and proves the secret by
/// `by`; otherwise it is told why (where it is still listening) and dropped.
async fn shake_link(
    mut s: TcpStream,
    peer: SocketAddr,
    by: Instant,
    secret: &GroupSecret,
    from: u32,
    to: u32,
) -> Option<TcpStream> {
    let _ = s.set_nodelay(true);
    let reason = match tokio::time::timeout_at(by, read_link_hello(&mut s, secret, from, to)).await
    {
        Ok(Ok(())) => match write_status(&mut s, Ok(())).await {
            Ok(()) => return Some(s),
            Err(e) => format!("the link went away: {e}"),
        },
        Ok(Err(TcpError::Rejected(m))) => m,
        Ok(Err(e)) => format!("bad data-link hello: {e}"),
        Err(_) => "no complete data-link hello in time".to_string(),
    };
    tracing::warn!(%peer, %reason, "refusing a weight data link");
    let _ = tokio::time::timeout(Duration::from_secs(1), write_status(&mut s, Err(&reason))).await;
    None
}

/// Reads a data hello for the link `from -> to`, challenges it, and checks the answer.
async fn read_link_hello(
    s: &mut TcpStream,
    secret: &GroupSecret,
    from: u32,
    to: u32,
) -> Result<(), TcpError> {
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).await?;
    if &magic != DATA_MAGIC {
        return Err(TcpError::Protocol(format!(
            "magic {magic:?} is not {DATA_MAGIC:?}: not a troupe weight data link"
        )));
    }
    let version = s.read_u16_le().await?;
    if version != VERSION {
        return Err(TcpError::Protocol(format!(
            "data-link version {version}, this engine speaks {VERSION}; run the same troupe \
             version on trainer and engines"
        )));
    }
    let (f, dest) = (s.read_u32_le().await?, s.read_u32_le().await?);
    if f != from || dest != to {
        return Err(TcpError::Rejected(format!(
            "rank {to} expects its data link from rank {from}, got one from rank {f} \
             addressed to rank {dest}"
        )));
    }
    let challenge = nonce()?;
    let mut ask = vec![0u8];
    ask.extend_from_slice(&challenge);
    s.write_all(&ask).await?;
    let mut tag = [0u8; TAG_BYTES];
    s.read_exact(&mut tag).await?;
    if !secret.verify(
        Purpose::Link,
        &[&challenge, &from.to_le_bytes(), &to.to_le_bytes()],
        &tag,
    ) {
        return Err(TcpError::Rejected(format!(
            "data link from rank {f} to rank {dest} does not prove this group's secret (another \
             group's, or a stranger's); re-create the group so every engine has the current \
             topology"
        )));
    }
    Ok(())
}
