//! Data links of the chain: a predecessor connects to its successor's listener and introduces
//! itself with the group token, so a stray connection is told apart from the real predecessor.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::frame::{read_status, write_status};
use super::{DATA_MAGIC, TcpError, VERSION};

/// Connects from rank `from` to rank `to`'s data address and performs the data hello.
pub(crate) async fn connect_link(
    addr: &str,
    token: u64,
    from: u32,
    to: u32,
    deadline: Instant,
) -> Result<TcpStream, TcpError> {
    let work = async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let mut hello = Vec::with_capacity(22);
        hello.extend_from_slice(DATA_MAGIC);
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&token.to_le_bytes());
        hello.extend_from_slice(&from.to_le_bytes());
        hello.extend_from_slice(&to.to_le_bytes());
        s.write_all(&hello).await?;
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
/// carrying `token`; strangers get a rejection naming what was wrong and the wait goes on.
pub(crate) async fn accept_link(
    listener: &TcpListener,
    token: u64,
    from: u32,
    to: u32,
    deadline: Instant,
) -> Result<TcpStream, TcpError> {
    loop {
        let (mut s, peer) = match tokio::time::timeout_at(deadline, listener.accept()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(TcpError::Timeout(format!(
                    "rank {from} never opened its data link to rank {to}"
                )));
            }
        };
        s.set_nodelay(true)?;
        let verdict = match tokio::time::timeout_at(deadline, read_link_hello(&mut s)).await {
            Ok(Ok((t, f, dest))) if t == token && f == from && dest == to => Ok(()),
            Ok(Ok((t, f, dest))) if t != token => Err(format!(
                "data hello from rank {f} to rank {dest} carries the token of another group; \
                 re-create the group so every engine has the current topology"
            )),
            Ok(Ok((_, f, dest))) => Err(format!(
                "rank {to} expects its data link from rank {from}, got one from rank {f} \
                 addressed to rank {dest}"
            )),
            Ok(Err(e)) => Err(format!("bad data-link hello: {e}")),
            Err(_) => continue,
        };
        match verdict {
            Ok(()) => {
                write_status(&mut s, Ok(())).await?;
                return Ok(s);
            }
            Err(reason) => {
                tracing::warn!(%peer, %reason, "refusing a weight data link");
                let _ = write_status(&mut s, Err(&reason)).await;
            }
        }
    }
}

async fn read_link_hello(s: &mut TcpStream) -> Result<(u64, u32, u32), TcpError> {
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
    Ok((
        s.read_u64_le().await?,
        s.read_u32_le().await?,
        s.read_u32_le().await?,
    ))
}
