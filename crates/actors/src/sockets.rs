//! Which process listens on a TCP port, read from Linux's `/proc`.
//!
//! A server is ready only when the process answering its port is the child that was launched:
//! with two deployments on one machine, a `/health` that answers on "our" port may come from
//! another deployment's engine (our child then fails with `EADDRINUSE`). Checking that the
//! listening socket belongs to the child's process group tells the two apart for any server
//! program (SGLang, vLLM, the reference engine), without asking it to prove anything.

use std::collections::BTreeSet;
use std::fs;

/// Whether a process of process group `pgid` holds a socket listening on TCP `port` (IPv4 or
/// IPv6). `None` where `/proc` cannot tell: not Linux, `/proc` unreadable, or no listener on
/// the port visible from this network namespace (a server in a namespace of its own); callers
/// then fall back to trusting the answer on the port. `Some(false)` means a listener is
/// visible and belongs to another process.
pub fn group_listens_on(pgid: u32, port: u16) -> Option<bool> {
    let inodes = listening_inodes(port)?;
    if inodes.is_empty() {
        return None;
    }
    let procs = fs::read_dir("/proc").ok()?;
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if process_group(pid) != Some(pgid) {
            continue;
        }
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = fs::read_link(fd.path())
                && let Some(inode) = socket_inode(&target.to_string_lossy())
                && inodes.contains(&inode)
            {
                return Some(true);
            }
        }
    }
    Some(false)
}

/// Inodes of the sockets listening on `port`, from `/proc/net/tcp` and `/proc/net/tcp6`;
/// `None` when neither file can be read.
fn listening_inodes(port: u16) -> Option<BTreeSet<u64>> {
    let mut found = BTreeSet::new();
    let mut readable = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        readable = true;
        found.extend(text.lines().skip(1).filter_map(|l| listener_inode(l, port)));
    }
    readable.then_some(found)
}

/// The inode of one `/proc/net/tcp` line if it is a listener on `port`.
fn listener_inode(line: &str, port: u16) -> Option<u64> {
    let cols: Vec<&str> = line.split_whitespace().collect();
    let local = cols.get(1)?;
    let (_, hex_port) = local.rsplit_once(':')?;
    const LISTEN: &str = "0A";
    if u16::from_str_radix(hex_port, 16).ok()? != port || *cols.get(3)? != LISTEN {
        return None;
    }
    cols.get(9)?.parse().ok()
}

/// The process group of `pid` (field 5 of `/proc/PID/stat`, after the parenthesised name).
fn process_group(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(2)?.parse().ok()
}

fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_tcp_lines() {
        let l = "   0: 0100007F:2710 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 123456 1 0000000000000000 100 0 0 10 0";
        assert_eq!(listener_inode(l, 10000), Some(123456));
        assert_eq!(listener_inode(l, 10001), None);
        let established = l.replace(" 0A ", " 01 ");
        assert_eq!(listener_inode(&established, 10000), None);
        assert_eq!(socket_inode("socket:[42]"), Some(42));
        assert_eq!(socket_inode("pipe:[42]"), None);
    }

    #[test]
    fn finds_this_process_group_listening_and_no_other() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let Some(me) = process_group(std::process::id()) else {
            return; // no /proc here: nothing to check
        };
        assert_eq!(group_listens_on(me, port), Some(true));
        assert_eq!(
            group_listens_on(me.wrapping_add(1_000_000), port),
            Some(false)
        );
        drop(l);
        assert_eq!(group_listens_on(me, port), None, "no listener: cannot tell");
    }
}
