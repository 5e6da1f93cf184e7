//! The machine's floor for a remote call: a raw loopback TCP ping-pong of a call-sized message
//! (no framing, no actor, no serialization) between an echo thread and this runtime's socket,
//! both ends polling their socket instead of sleeping until it is readable (a thread woken from
//! sleep costs tens of microseconds on a VM, and Troupe's framed client polls a lone call's
//! reply too, so a sleeping floor would be slower than the calls it is the floor of).
//! `rpc.remote.seq.p50_us` over `rpc.floor.seq.p50_us` is how far a Troupe call is from what
//! the socket allows.

use std::io::{Read, Write};
use std::net::TcpListener;

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
            s.set_nonblocking(true)?;
            let mut got = 0;
            while got < MESSAGE_BYTES {
                match s.read(&mut buf[got..]) {
                    Ok(0) => return Ok(()), // the client closed: done
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                    Err(e) => return Err(e),
                }
            }
            s.set_nonblocking(false)?;
            s.write_all(&buf)?;
        }
    });
    // The calling end polls a plain non-blocking socket: tokio's `try_read` only reads once
    // its reactor has seen the socket readable, which a polling loop would never let it see.
    let stream = std::net::TcpStream::connect(addr).map_err(|e| format!("floor: connect: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("floor: nodelay: {e}"))?;
    let stream = std::sync::Mutex::new(stream);
    let call = |i: u64| {
        let stream = &stream;
        async move {
            let mut msg = [0u8; MESSAGE_BYTES];
            msg[..8].copy_from_slice(&i.to_le_bytes());
            let mut s = stream
                .lock()
                .map_err(|_| "floor: the socket's lock is poisoned".to_string())?;
            s.set_nonblocking(false)
                .map_err(|e| format!("floor: {e}"))?;
            s.write_all(&msg).map_err(|e| format!("floor: {e}"))?;
            s.set_nonblocking(true).map_err(|e| format!("floor: {e}"))?;
            let mut got = 0;
            while got < MESSAGE_BYTES {
                match s.read(&mut msg[got..]) {
                    Ok(0) => return Err("floor: the echo closed".into()),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                    Err(e) => return Err(format!("floor: {e}")),
                }
            }
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
