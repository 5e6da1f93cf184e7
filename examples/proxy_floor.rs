//! The floor for an HTTP/1 router on this machine: a reverse proxy that does nothing a router
//! must (no routing policy, health, retries, breakers, limits, timeouts, error envelope, JSON,
//! chunked bodies or streaming), written by hand on tokio and `httparse`: it reads a request
//! head and its `Content-Length` body, writes them unchanged to the next backend (round robin,
//! kept-alive connections, one pool per thread), reads the answer the same way and writes it
//! back. Two socket writes and two reads per request, as any proxy needs.
//!
//! It exists to be measured against (`PEER=floor bash scripts/bench-routers.sh`): what is left of
//! a router's cost per request once all of its work is gone is the kernel's loopback TCP path
//! and a minimal event loop, and that bounds the gateway's added latency in a closed loop on a
//! small machine (`concurrency × CPU per request / cores`). Not for any other use.
//!
//! Run: `cargo run --release --example proxy_floor -- 127.0.0.1:0 http://<ip>:<port>...` (port 0:
//! any free one; it prints the address it listens on; one serving thread per core, each on its own
//! single-threaded runtime, as `troupe gateway` serves).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request or answer (head and body) this proxy takes.
const MAX_MESSAGE: usize = 16 << 20;

/// Kept-alive connections to each backend, on one thread.
type Pool = Arc<Mutex<Vec<Vec<TcpStream>>>>;

/// Reads one HTTP/1 message (head and `Content-Length` body) into `buf`; its length, or `None`
/// when the peer closed, sent something unparsable or chunked, or too much.
async fn read_message(s: &mut TcpStream, buf: &mut Vec<u8>, request: bool) -> Option<usize> {
    buf.clear();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let head = if request {
            httparse::Request::new(&mut headers).parse(buf).ok()?
        } else {
            httparse::Response::new(&mut headers).parse(buf).ok()?
        };
        if let httparse::Status::Complete(n) = head {
            let header = |name: &str| {
                headers
                    .iter()
                    .take_while(|h| !h.name.is_empty())
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| h.value)
            };
            if header("transfer-encoding").is_some() {
                return None;
            }
            let len = match header("content-length") {
                Some(v) => std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok()?,
                None => 0,
            };
            let total = n.checked_add(len).filter(|t| *t <= MAX_MESSAGE)?;
            while buf.len() < total {
                buf.reserve(total - buf.len());
                if s.read_buf(buf).await.ok()? == 0 {
                    return None;
                }
            }
            return Some(total);
        }
        if buf.len() >= MAX_MESSAGE {
            return None;
        }
        buf.reserve(4096);
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// A new connection to `addr`.
async fn connect(addr: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect(addr).await.ok()?;
    let _ = s.set_nodelay(true);
    Some(s)
}

/// Sends the request in `req` over `up` and reads the answer into `resp`; its length.
async fn exchange(up: &mut TcpStream, req: &[u8], resp: &mut Vec<u8>) -> Option<usize> {
    up.write_all(req).await.ok()?;
    read_message(up, resp, false).await
}

/// Serves one client connection until it closes or anything fails (then both ends close).
async fn serve(
    mut client: TcpStream,
    backends: Arc<Vec<SocketAddr>>,
    pool: Pool,
    next: Arc<AtomicUsize>,
) {
    let (mut req, mut resp) = (Vec::with_capacity(4096), Vec::with_capacity(4096));
    while let Some(n) = read_message(&mut client, &mut req, true).await {
        let i = next.fetch_add(1, Ordering::Relaxed) % backends.len();
        let kept = pool.lock().ok().and_then(|mut p| p[i].pop());
        // A kept connection the backend has closed since (it restarted, or its keep-alive
        // timeout passed) fails at once: the request goes again on a new connection (unlike
        // hyper's client, also when the backend may have read it: a floor, not a router).
        let mut answered = None;
        if let Some(mut up) = kept {
            answered = exchange(&mut up, &req[..n], &mut resp)
                .await
                .map(|m| (up, m));
        }
        if answered.is_none() {
            let Some(mut up) = connect(backends[i]).await else {
                return;
            };
            answered = exchange(&mut up, &req[..n], &mut resp)
                .await
                .map(|m| (up, m));
        }
        let Some((up, m)) = answered else { return };
        if let Ok(mut p) = pool.lock() {
            p[i].push(up);
        }
        if client.write_all(&resp[..m]).await.is_err() {
            return;
        }
    }
}

/// One serving thread: accepts from `listener` and serves each connection on this thread.
fn thread(listener: std::net::TcpListener, backends: Arc<Vec<SocketAddr>>) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::from_std(listener)?;
        let pool: Pool = Arc::new(Mutex::new(backends.iter().map(|_| Vec::new()).collect()));
        let next = Arc::new(AtomicUsize::new(0));
        loop {
            // A failed accept (a connection reset before it was taken, no file descriptors
            // left) ends neither the thread nor the measurement.
            let c = match listener.accept().await {
                Ok((c, _)) => c,
                Err(e) => {
                    eprintln!("proxy_floor: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = c.set_nodelay(true);
            tokio::spawn(serve(c, backends.clone(), pool.clone(), next.clone()));
        }
    })
}

/// `http://host:port` as a socket address.
fn backend(url: &str) -> Result<SocketAddr, String> {
    let hostport = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/');
    hostport
        .parse()
        .map_err(|_| format!("backend {url:?}: expected http://<ip>:<port>"))
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: proxy_floor <listen ip:port> <backend http://ip:port>...";
    let (listen, urls) = args.split_first().ok_or(usage)?;
    if urls.is_empty() {
        return Err(usage.into());
    }
    let backends = Arc::new(
        urls.iter()
            .map(|u| backend(u))
            .collect::<Result<Vec<_>, _>>()?,
    );
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!("proxy_floor listening on http://{addr}");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut running = Vec::new();
    for i in 0..threads {
        let (l, b) = (
            listener.try_clone().map_err(|e| e.to_string())?,
            backends.clone(),
        );
        let t = std::thread::Builder::new()
            .name(format!("floor-io-{i}"))
            .spawn(move || thread(l, b))
            .map_err(|e| e.to_string())?;
        running.push(t);
    }
    for t in running {
        match t.join() {
            Ok(r) => r.map_err(|e| e.to_string())?,
            Err(_) => return Err("a serving thread panicked".into()),
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proxy_floor: {e}");
            ExitCode::from(2)
        }
    }
}
