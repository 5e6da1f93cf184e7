//! Asking an interpreter a question: run it with a bound on time and output, and read its
//! answer. Used where Troupe needs to know what an engine's Python has before launching it
//! (`vllm_plugin.rs`: Troupe's vLLM plugin; the controller's `installed_args.rs`: the installed
//! vLLM's version and arguments). Synchronous, for plan-time code; async callers run it on a
//! blocking thread.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The most a child's output may hold.
const MAX_OUTPUT: u64 = 4 << 20;

/// Runs `python args`, feeding `stdin`; its standard output when it exits 0 within `limit`
/// (killed past it), else what went wrong with the last lines of its standard error.
pub fn run(
    python: &str,
    args: &[&str],
    stdin: Option<&str>,
    limit: Duration,
) -> Result<String, String> {
    let mut child = Command::new(python)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let text = text.to_string();
        std::thread::spawn(move || {
            let _ = pipe.write_all(text.as_bytes());
        });
    }
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = String::new();
            if let Some(p) = pipe {
                let _ = p.take(MAX_OUTPUT).read_to_string(&mut buf);
            }
            buf
        })
    };
    let out = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{python} took longer than {} s", limit.as_secs()));
            }
            Err(e) => return Err(format!("waiting for {python}: {e}")),
        }
    };
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    if status.success() {
        Ok(out)
    } else {
        let last: Vec<&str> = err.lines().rev().take(3).collect();
        Err(format!(
            "{python} exited with {status}: {}",
            last.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ))
    }
}
