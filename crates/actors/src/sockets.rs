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
    // The group's leader (the launched process itself) usually holds the listener: looked at
    // first, so a check costs one process's descriptors, not a walk of every process on the
    // machine (with hundreds of servers starting at once, that walk was per server).
    if process_group(pgid) == Some(pgid) && holds_any(pgid, &inodes) {
        return Some(true);
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
        if pid == pgid || process_group(pid) != Some(pgid) {
            continue;
        }
        if holds_any(pid, &inodes) {
            return Some(true);
        }
    }
    Some(false)
}

/// Whether process `pid` has a descriptor on one of the sockets `inodes`.
fn holds_any(pid: u32, inodes: &BTreeSet<u64>) -> bool {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        fs::read_link(fd.path())
            .ok()
            .and_then(|target| socket_inode(&target.to_string_lossy()))
            .is_some_and(|inode| inodes.contains(&inode))
    })
}

/// Inodes of the sockets listening on `port`: asked of the kernel over sock_diag where it
/// answers, else read from `/proc/net/tcp` and `/proc/net/tcp6`; `None` when neither works.
fn listening_inodes(port: u16) -> Option<BTreeSet<u64>> {
    #[cfg(target_os = "linux")]
    if let Some(found) = diag::listening_inodes(port) {
        return Some(found);
    }
    listening_inodes_proc(port)
}

/// [`listening_inodes`] from `/proc/net/tcp` and `/proc/net/tcp6`. Each read formats every TCP
/// socket of the machine (and walks the whole connection table), so with hundreds of servers
/// starting at once these reads grow with the square of their number: the fallback only.
fn listening_inodes_proc(port: u16) -> Option<BTreeSet<u64>> {
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

/// The listeners on a port asked of the kernel over `NETLINK_SOCK_DIAG`, as `ss -ltn` does: a
/// dump of TCP sockets in state LISTEN whose local port is the one asked, filtered in the
/// kernel, so its cost does not grow with the machine's connections or their text.
#[cfg(target_os = "linux")]
mod diag {
    use std::collections::BTreeSet;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// `SOCK_DIAG_BY_FAMILY`: the request and answer message type.
    const BY_FAMILY: u16 = 20;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    /// `TCP_LISTEN` in the kernel's TCP states.
    const TCP_LISTEN: u32 = 10;
    /// `struct nlmsghdr`.
    const HDR: usize = 16;
    /// `struct inet_diag_req_v2`.
    const REQ: usize = 56;
    /// Where `idiag_inode` lies in `struct inet_diag_msg`.
    const INODE_AT: usize = 68;
    /// Answers read before giving up (a dump of one port's listeners is one or two).
    const MOST_READS: usize = 64;

    /// Inodes of the IPv4 and IPv6 sockets listening on TCP `port`; `None` when sock_diag
    /// cannot answer (no netlink, no `inet_diag` module, a sandbox that refuses it).
    pub(super) fn listening_inodes(port: u16) -> Option<BTreeSet<u64>> {
        // SAFETY: socket(2) with constant arguments; a valid result is a fresh descriptor
        // that nothing else owns, so `OwnedFd` may close it.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: see above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut found = BTreeSet::new();
        for family in [libc::AF_INET, libc::AF_INET6] {
            found.extend(dump(&fd, family as u8, port)?);
        }
        Some(found)
    }

    /// The request: a dump of `family` TCP sockets in LISTEN on local port `port`.
    fn request(family: u8, port: u16) -> [u8; HDR + REQ] {
        let mut m = [0u8; HDR + REQ];
        m[0..4].copy_from_slice(&((HDR + REQ) as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&BY_FAMILY.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        m[6..8].copy_from_slice(&flags.to_ne_bytes());
        m[8..12].copy_from_slice(&1u32.to_ne_bytes()); // sequence number
        let r = &mut m[HDR..];
        r[0] = family;
        r[1] = libc::IPPROTO_TCP as u8;
        r[4..8].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
        r[8..10].copy_from_slice(&port.to_be_bytes()); // id.idiag_sport, network order
        r[48..56].fill(0xff); // id.idiag_cookie: INET_DIAG_NOCOOKIE
        m
    }

    fn dump(fd: &OwnedFd, family: u8, port: u16) -> Option<Vec<u64>> {
        let req = request(family, port);
        // SAFETY: send(2) of a buffer we own, with its length; an unconnected netlink socket
        // sends to the kernel.
        let sent = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
        if usize::try_from(sent).ok() != Some(req.len()) {
            return None;
        }
        let mut buf = vec![0u8; 32 * 1024];
        let mut out = Vec::new();
        for _ in 0..MOST_READS {
            // SAFETY: recv(2) into a buffer we own, with its length. The kernel fills a dump's
            // answers while the request is sent and while the previous answer is read, so a
            // read never has to wait; one that would (MSG_DONTWAIT) gives up instead.
            let n = unsafe {
                libc::recv(
                    fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            let n = usize::try_from(n).ok().filter(|n| *n > 0)?;
            if let Some(done) = parse(&buf[..n], &mut out)? {
                return done.then_some(out);
            }
        }
        None
    }

    /// Adds the inodes of one read's messages to `out`: `Some(Some(true))` at the end of the
    /// dump, `Some(Some(false))` on an error answer, `Some(None)` when more is to come, `None`
    /// for a malformed read.
    fn parse(mut read: &[u8], out: &mut Vec<u64>) -> Option<Option<bool>> {
        while read.len() >= HDR {
            let len = u32::from_ne_bytes(read[0..4].try_into().ok()?) as usize;
            let kind = u16::from_ne_bytes(read[4..6].try_into().ok()?);
            if len < HDR || len > read.len() {
                return None;
            }
            match kind {
                NLMSG_DONE => return Some(Some(true)),
                NLMSG_ERROR => return Some(Some(false)),
                BY_FAMILY => {
                    let inode = read.get(HDR + INODE_AT..HDR + INODE_AT + 4)?;
                    out.push(u64::from(u32::from_ne_bytes(inode.try_into().ok()?)));
                }
                _ => {}
            }
            read = read.get((len + 3) & !3..).unwrap_or_default();
        }
        Some(None)
    }
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

    #[test]
    fn sock_diag_and_proc_find_the_same_listeners() {
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = v4.local_addr().unwrap().port();
        // A connection to it: established sockets on the port are not listeners.
        let _c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let Some(proc) = listening_inodes_proc(port) else {
            return; // no /proc here
        };
        assert_eq!(proc.len(), 1, "{proc:?}");
        #[cfg(target_os = "linux")]
        if let Some(diag) = diag::listening_inodes(port) {
            assert_eq!(diag, proc);
        }
        assert_eq!(listening_inodes(port), Some(proc));
        drop(v4);
        assert_eq!(listening_inodes(port).map(|s| s.len()), Some(0));
    }
}
