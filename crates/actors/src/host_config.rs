//! [`HostConfig`]: how a host describes itself and the bounds it serves under, from
//! `troupe host`'s flags or a controller's in-process hosts.

use std::time::Duration;

/// How a host describes itself; fixed for the host's lifetime (the address may be set once the
/// listener is bound).
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Stable id of this host (defaults to a fresh uuid).
    pub host_id: String,
    /// GPU ids this host offers.
    pub gpu_ids: Vec<u32>,
    /// CPU cores this host offers.
    pub cpus: u32,
    /// Memory this host offers, in bytes.
    pub memory_bytes: u64,
    /// Interval between heartbeats on `Watch`.
    pub heartbeat_interval: Duration,
    /// Largest payload accepted or produced by a call.
    pub max_message_bytes: u64,
    /// Grace given to each actor when the host shuts down.
    pub shutdown_grace: Duration,
    /// Control-plane token every gRPC request must carry (None: no check; loopback only).
    pub auth_token: Option<String>,
    /// Serve gRPC over TLS with this certificate and key (None: plaintext).
    pub tls: Option<crate::tls::ServerTls>,
    /// An actor that ran this long since its last (re)start is stable again: its next restart
    /// waits only the policy's base back-off instead of the doubled one.
    pub stable_after: Duration,
    /// Stop the host when no controller has watched it this long (None: never). See
    /// [`crate::orphan`].
    pub orphan_grace: Option<Duration>,
    /// The state file a controller could recover this host from (`troupe serve`'s): with one
    /// set, the orphan grace applies only while the file exists and names this host's pid;
    /// otherwise an orphaned host stops within seconds (see [`crate::orphan`]).
    pub recovery_file: Option<std::path::PathBuf>,
    /// A new connection must say what it is within this: a framed call's whole hello (magic
    /// and token), or HTTP/2's whole 24-byte preface. Past it, the connection is closed.
    pub handshake_timeout: Duration,
    /// Most connections at once that have not yet identified themselves (and, for framed
    /// calls, shown the token); more are closed at once, so silent connections cannot take
    /// every descriptor from the controller's.
    pub max_pending_connections: usize,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            host_id: uuid::Uuid::new_v4().to_string(),
            gpu_ids: Vec::new(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            memory_bytes: 0,
            heartbeat_interval: Duration::from_millis(250),
            stable_after: Duration::from_secs(60),
            max_message_bytes: 64 << 20,
            shutdown_grace: Duration::from_secs(5),
            auth_token: None,
            recovery_file: None,
            handshake_timeout: Duration::from_secs(10),
            max_pending_connections: 256,
            tls: None,
            orphan_grace: None,
        }
    }
}
