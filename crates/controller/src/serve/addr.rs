//! Addresses as the serving side spells them, and the one reading of "that port was taken":
//! fork, re-placement, routing and recovery all place servers, proxies and the control server
//! on a host's machine. They live here, below all of them, so that none of those modules
//! depends on another for a string helper (fork → replace → fork was a cycle).

/// Whether a launch error says the port was taken.
pub(crate) fn port_in_use_text(m: &str) -> bool {
    m.contains("Address already in use") || m.contains("EADDRINUSE") || m.contains("os error 98")
}

/// The machine part of a host address (`inproc://…` hosts are this machine).
pub(crate) fn machine(addr: &str) -> String {
    if addr.starts_with("inproc://") {
        return "127.0.0.1".into();
    }
    match addr.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => {
            h.trim_start_matches('[').trim_end_matches(']').to_string()
        }
        _ => addr.to_string(),
    }
}

/// `host:port`, bracketing IPv6 hosts.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
