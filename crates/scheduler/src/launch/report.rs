//! The rendezvous: how a launched host tells the controller where it listens.
//!
//! A host started by Slurm cannot print its address to the controller's pipe (it runs on
//! another node), and its routable address is only known on that node. So the controller
//! listens on a TCP port and passes `--report-to IP:PORT` to every host; the host connects,
//! takes the local IP of that connection as its own routable address (the interface that
//! reaches the controller), binds its gRPC service there, and sends one JSON line
//! ([`HostReport`], carrying the control-plane token). The controller answers `ok` or
//! `refused: why`, and keeps the connection open: when the controller process goes away,
//! however it dies, the hosts see the connection close and shut down, so a killed controller
//! does not leave a job holding GPUs until its time limit.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use tokio::sync::mpsc;

use super::{LaunchError, LaunchRequest};

/// Longest report line accepted (a report is a few hundred bytes).
const MAX_LINE: u64 = 64 * 1024;
/// How long a connected peer may take to send its report.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What a host sends once its gRPC service is listening.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostReport {
    /// The control-plane token (hosts without the controller's token are refused).
    #[serde(default)]
    pub token: Option<String>,
    /// Position of this host (Slurm: `SLURM_PROCID`).
    pub index: usize,
    /// The host's id.
    pub host_id: String,
    /// Where its gRPC service listens (`ip:port`).
    pub addr: String,
    /// Node name (`SLURMD_NODENAME`, else the hostname).
    pub node: String,
    /// GPU ids it offers.
    pub gpus: Vec<u32>,
}

impl std::fmt::Debug for HostReport {
    // Never print the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostReport")
            .field("index", &self.index)
            .field("host_id", &self.host_id)
            .field("addr", &self.addr)
            .field("node", &self.node)
            .field("gpus", &self.gpus)
            .finish()
    }
}

/// What [`Rendezvous::next`] got from one connection.
#[derive(Debug)]
pub enum Arrival {
    /// A valid report; the stream is the host's liveness link (drop it to tell the host to stop).
    Report(HostReport, TcpStream),
    /// A connection that was refused (bad token, malformed line), with the reason it was told.
    Refused(String),
}

/// The controller's side: a listener hosts report to.
pub struct Rendezvous {
    listener: TcpListener,
    address: String,
    token: Option<String>,
}

fn same(a: &str, b: &str) -> bool {
    // Constant-time in the content, so the comparison does not leak a prefix.
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl Rendezvous {
    /// Listens on `ip` (port 0); hosts must present `token` when one is given.
    pub async fn bind(ip: IpAddr, token: Option<String>) -> Result<Rendezvous, LaunchError> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(|e| LaunchError::Rendezvous(format!("cannot listen on {ip}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| LaunchError::Rendezvous(e.to_string()))?
            .port();
        Ok(Rendezvous {
            listener,
            address: SocketAddr::new(ip, port).to_string(),
            token,
        })
    }

    /// The address hosts dial (`--report-to`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Waits for the next connection and reads its report.
    pub async fn next(&self) -> Result<Arrival, LaunchError> {
        let (stream, peer) = self
            .listener
            .accept()
            .await
            .map_err(|e| LaunchError::Rendezvous(format!("accept failed: {e}")))?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        let read = tokio::time::timeout(
            READ_TIMEOUT,
            (&mut reader).take(MAX_LINE).read_line(&mut line),
        )
        .await;
        let mut stream = reader.into_inner();
        let verdict = match read {
            Err(_) => Err(format!("{peer} sent no report within {READ_TIMEOUT:?}")),
            Ok(Err(e)) => Err(format!("{peer}: {e}")),
            Ok(Ok(_)) => match serde_json::from_str::<HostReport>(line.trim()) {
                Err(e) => Err(format!("{peer} sent a malformed report: {e}")),
                Ok(r) => match (&self.token, &r.token) {
                    (Some(want), Some(got)) if same(want, got) => Ok(r),
                    (None, _) => Ok(r),
                    _ => Err(format!(
                        "{peer} ({}) did not present the control-plane token",
                        r.host_id
                    )),
                },
            },
        };
        match verdict {
            Ok(mut r) => {
                r.token = None;
                stream
                    .write_all(b"ok\n")
                    .await
                    .map_err(|e| LaunchError::Rendezvous(format!("{peer}: {e}")))?;
                Ok(Arrival::Report(r, stream))
            }
            Err(why) => {
                let _ = stream
                    .write_all(format!("refused: {why}\n").as_bytes())
                    .await;
                Ok(Arrival::Refused(why))
            }
        }
    }
}

/// The task reading a rendezvous' arrivals ([`open_reports`]); stopped by [`Accepting::abort`]
/// or when dropped, so no error path leaves it listening.
pub struct Accepting(tokio::task::JoinHandle<()>);

impl Accepting {
    /// Stops reading arrivals (the rendezvous closes).
    pub fn abort(&self) {
        self.0.abort();
    }
}

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a launcher waits on: each arrival, or the error that ended the rendezvous (the last).
pub type Arrivals = mpsc::Receiver<Result<Arrival, LaunchError>>;

/// Opens a rendezvous on `ip` for `req`'s hosts, which run on other machines (`who`: the
/// launcher, named in the refusal), so they must be at least one and carry a token; its
/// arrivals are read on a task of their own, so a launcher can wait on them beside its job's
/// state. The address hosts dial (`--report-to`), the arrivals, and the task.
pub async fn open_reports(
    ip: IpAddr,
    req: &LaunchRequest,
    who: &str,
) -> Result<(String, Arrivals, Accepting), LaunchError> {
    if req.n_hosts == 0 {
        return Err(LaunchError::Config("at least one host is needed".into()));
    }
    if req.token.is_none() {
        return Err(LaunchError::Config(format!(
            "{who} hosts listen on routable addresses and need a control-plane token (set TROUPE_TOKEN)"
        )));
    }
    let rv = Rendezvous::bind(ip, req.token.clone()).await?;
    let address = rv.address().to_string();
    let (tx, arrivals) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        loop {
            let a = rv.next().await;
            let stop = a.is_err();
            if tx.send(a).await.is_err() || stop {
                break;
            }
        }
    });
    Ok((address, arrivals, Accepting(task)))
}

/// The host's side: a connection to the controller's rendezvous.
pub struct ReportLink {
    stream: BufReader<TcpStream>,
}

impl ReportLink {
    /// Connects to the controller at `to` (`host:port`), retrying for up to `timeout`.
    pub async fn connect(to: &str, timeout: Duration) -> Result<ReportLink, LaunchError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match TcpStream::connect(to).await {
                Ok(s) => {
                    return Ok(ReportLink {
                        stream: BufReader::new(s),
                    });
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(LaunchError::Rendezvous(format!(
                        "cannot reach the controller at {to}: {e}"
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// This end's IP: the address of the interface that reaches the controller.
    pub fn local_ip(&self) -> Result<IpAddr, LaunchError> {
        self.stream
            .get_ref()
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| LaunchError::Rendezvous(e.to_string()))
    }

    /// Sends the report and waits for the controller's verdict.
    pub async fn send(&mut self, report: &HostReport) -> Result<(), LaunchError> {
        let mut line = serde_json::to_string(report)
            .map_err(|e| LaunchError::Rendezvous(format!("cannot encode report: {e}")))?;
        line.push('\n');
        let io = |e: std::io::Error| LaunchError::Rendezvous(format!("report failed: {e}"));
        self.stream
            .get_mut()
            .write_all(line.as_bytes())
            .await
            .map_err(io)?;
        let mut reply = String::new();
        tokio::time::timeout(READ_TIMEOUT, self.stream.read_line(&mut reply))
            .await
            .map_err(|_| LaunchError::Rendezvous("the controller did not answer".into()))?
            .map_err(io)?;
        match reply.trim() {
            "ok" => Ok(()),
            other => Err(LaunchError::Rendezvous(format!(
                "the controller refused this host: {}",
                other.strip_prefix("refused: ").unwrap_or(other)
            ))),
        }
    }

    /// Resolves when the controller closes the connection (or its process dies).
    pub async fn closed(mut self) {
        let mut buf = [0u8; 256];
        while let Ok(n) = self.stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    }
}

/// GPU ids from a `CUDA_VISIBLE_DEVICES` value (Slurm sets it from `--gres=gpu:N`).
pub fn parse_visible_devices(value: &str) -> Result<Vec<u32>, String> {
    let v = value.trim();
    if v.is_empty() || v == "NoDevFiles" {
        return Ok(Vec::new());
    }
    v.split(',')
        .map(|s| {
            s.trim().parse::<u32>().map_err(|_| {
                format!(
                    "CUDA_VISIBLE_DEVICES={v:?}: expected comma-separated GPU indices (got {s:?}); pass --gpus explicitly"
                )
            })
        })
        .collect()
}

/// This node's name: `SLURMD_NODENAME` inside a Slurm task, else the hostname.
pub fn node_name() -> String {
    if let Some(n) = std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|n| !n.is_empty())
    {
        return n;
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The IP other machines most likely reach this one on: the source address of the default
/// route (a UDP "connect" sends nothing), else loopback.
pub fn routable_ip() -> IpAddr {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|s| {
        s.connect("198.51.100.1:9")?;
        s.local_addr()
    });
    match probe {
        Ok(a) if !a.ip().is_unspecified() => a.ip(),
        _ => IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_parse_and_errors_say_what_to_do() {
        assert_eq!(parse_visible_devices("0,1,3").unwrap(), vec![0, 1, 3]);
        assert_eq!(parse_visible_devices("").unwrap(), Vec::<u32>::new());
        let e = parse_visible_devices("GPU-8a3c,GPU-77").unwrap_err();
        assert!(e.contains("--gpus"), "{e}");
    }

    fn report(token: Option<&str>) -> HostReport {
        HostReport {
            token: token.map(str::to_string),
            index: 1,
            host_id: "host-1".into(),
            addr: "127.0.0.1:5".into(),
            node: "n2".into(),
            gpus: vec![0],
        }
    }

    #[tokio::test]
    async fn reports_need_the_token_and_the_link_closes_with_the_controller() {
        let rv = Rendezvous::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), Some("s3cret".into()))
            .await
            .unwrap();
        let to = rv.address().to_string();
        let bad = tokio::spawn({
            let to = to.clone();
            async move {
                let mut l = ReportLink::connect(&to, Duration::from_secs(5)).await?;
                l.send(&report(Some("wrong"))).await
            }
        });
        match tokio::time::timeout(Duration::from_secs(10), rv.next()).await {
            Ok(Ok(Arrival::Refused(why))) => assert!(why.contains("token"), "{why}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let e = bad.await.unwrap().unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");

        let good = tokio::spawn(async move {
            let mut l = ReportLink::connect(&to, Duration::from_secs(5)).await?;
            l.send(&report(Some("s3cret"))).await?;
            l.closed().await;
            Ok::<(), LaunchError>(())
        });
        let stream = match tokio::time::timeout(Duration::from_secs(10), rv.next()).await {
            Ok(Ok(Arrival::Report(r, s))) => {
                assert_eq!(r.node, "n2");
                assert_eq!(r.token, None, "the token is not kept");
                s
            }
            other => panic!("expected a report, got {other:?}"),
        };
        drop(stream);
        tokio::time::timeout(Duration::from_secs(10), good)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
