//! The machine's floor for a remote call: a raw loopback TCP ping-pong of a call-sized message
//! (no framing, no actor, no serialization), a blocking echo thread on one end and this
//! runtime's socket on the other, as the framed client's is. `rpc.remote.seq.p50_us` over
//! `rpc.floor.seq.p50_us` is how far a Troupe call is from what the socket allows.

use std::io::{Read, Write};
use std::net::TcpListener;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

/// Bytes each way: about a framed `Echo` call and its reply (header, actor id, method,
/// MessagePack payload).
pub const MESSAGE_BYTES: usize = 64;

/// Measures the ping-pong with `sequential` (the same loop as every other path) and returns
/// what it printed into `out`.
pub async fn measure(calls: u64, out: &mut Vec<(String, f64)>) -> Result<(), String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("floor: bind: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("floor: address: {e}"))?;
    // The echo end: one blocking thread, as a host's reader is one task on its own core.
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; MESSAGE_BYTES];
        loop {
            if s.read_exact(&mut buf).is_err() {
                return Ok(()); // the client closed: done
            }
            s.write_all(&buf)?;
        }
    });
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("floor: connect: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("floor: nodelay: {e}"))?;
    let stream = Mutex::new(stream);
    let call = |i: u64| {
        let stream = &stream;
        async move {
            let mut msg = [0u8; MESSAGE_BYTES];
            msg[..8].copy_from_slice(&i.to_le_bytes());
            let mut s = stream.lock().await;
            s.write_all(&msg).await.map_err(|e| format!("floor: {e}"))?;
            s.read_exact(&mut msg)
                .await
                .map_err(|e| format!("floor: {e}"))?;
            if msg[..8] != i.to_le_bytes() {
                return Err("floor: the echo answered another message".into());
            }
            Ok(())
        }
    };
    super::rpc::sequential("floor", calls, call, out).await?;
    drop(stream);
    echo.join()
        .map_err(|_| "floor: the echo thread panicked".to_string())?
        .map_err(|e| format!("floor: echo: {e}"))
}
