//! Process helpers for tests that start real processes and check none is left behind.

use std::time::Duration;

/// True while `pid` exists and is not a zombie (a zombie is gone for our purposes).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Waits (at most 30 s, else the test fails) until `pid` is gone.
pub async fn wait_dead(pid: u32) {
    super::Poll::every(Duration::from_millis(20))
        .secs(30)
        .until(&format!("process {pid} is gone"), || async { !alive(pid) })
        .await
}

/// The parent of `pid`, if it still exists.
pub fn parent_of(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Every live process whose parent is `parent`.
pub fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|p| parent_of(*p) == Some(parent) && alive(*p))
                .collect()
        })
        .unwrap_or_default()
}

/// SIGKILL, ignoring a process that is already gone.
pub fn kill9(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// A reference engine as a child process of its own (`troupe engine --port 0`), so a test can
/// freeze it (SIGSTOP) or kill it; killed when dropped.
pub struct EngineProcess {
    /// The child (killed on drop).
    pub child: tokio::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl EngineProcess {
    /// Starts one with `extra` flags and waits for its `engine listening on` line.
    pub async fn start(extra: &[&str]) -> EngineProcess {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
            .args(["engine", "--port", "0"])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("troupe engine starts");
        let out = child.stdout.take().expect("stdout piped");
        let mut lines = tokio::io::BufReader::new(out).lines();
        let addr = super::within(60, async {
            loop {
                let line = lines
                    .next_line()
                    .await
                    .expect("engine stdout")
                    .expect("the engine printed its address before exiting");
                if let Some(a) = line.strip_prefix("engine listening on ") {
                    return a.trim().to_string();
                }
            }
        })
        .await;
        // Keep draining stdout so the engine never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        EngineProcess {
            child,
            url: format!("http://{addr}"),
        }
    }

    /// The engine's pid.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    /// Sends `sig` to the engine.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), sig)
            .expect("signal sent");
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        // A stopped process dies of SIGKILL too; continue it first anyway so nothing is left
        // stopped if the kill is refused.
        if let Some(pid) = self.child.id() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The address a `troupe host --listen 127.0.0.1:0` child listens on: its first stdout line
/// (`host listening on ADDR`), read from `child`'s piped stdout.
pub async fn host_address(child: &mut tokio::process::Child) -> String {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let out = child.stdout.take().expect("the host's stdout is piped");
    let line = BufReader::new(out)
        .lines()
        .next_line()
        .await
        .expect("reading the host's stdout")
        .expect("the host printed its address");
    line.strip_prefix("host listening on ")
        .expect("ready line")
        .to_string()
}
