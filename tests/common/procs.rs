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
    super::within(30, async {
        while alive(pid) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
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
