//! What the serving watcher reports (`ServingEvent`): a server removed, held, caught up,
//! readmitted, replaced or lost, and a lost (or re-placed) gateway; and what scaling the fleet does (`scale.rs`:
//! a server added, draining, retired). The watcher (`watch.rs`) sends them and the
//! deployment (`deployment.rs`) hands out their channel; they live here, below both, so that
//! the deployment does not depend on the watcher (deployment → watch → replace → routing →
//! deployment was a cycle).

/// Something the watcher did, for logs, tests and the capacity report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServingEvent {
    /// A server left the router because its process died.
    Removed {
        /// Its URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A restarted server is alive but waits for the current weights before it is routed.
    Held {
        /// Its URL.
        url: String,
    },
    /// A restarted server received the current weights by itself.
    CaughtUp {
        /// Its URL.
        url: String,
        /// The version it now holds.
        version: troupe_wire::WeightVersion,
    },
    /// A server is routed again (or, for an added one, for the first time).
    Readmitted {
        /// Its URL.
        url: String,
    },
    /// A lost server was launched again on another host, in the old one's slot.
    Replaced {
        /// The lost server's URL.
        old: String,
        /// The new server's URL.
        new: String,
        /// The host it now runs on.
        host: usize,
    },
    /// The gateway's host is lost, and the gateway with it, and no new gateway could be
    /// started (no host survives, or none would start it): the deployment must be restarted;
    /// said loudly.
    GatewayLost {
        /// The host it ran on.
        host: usize,
        /// Why the host is lost.
        reason: String,
    },
    /// The gateway's host was lost and a new gateway serves on another host
    /// (`gateway_replace.rs`): at the old URL when it could bind it, with the recorded agent
    /// sessions read back from its session directory and every serving server registered.
    GatewayReplaced {
        /// The host that was lost.
        lost: usize,
        /// The host the new gateway runs on.
        host: usize,
        /// The URL clients use now.
        url: String,
    },
    /// A server is gone for good (restart budget spent, or its host is lost): serving goes on
    /// with less capacity.
    Lost {
        /// Its URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A server was added to the running fleet (`Deployment::add_servers`): launched on free
    /// GPUs, and held (not routed) until it holds the fleet's weights; `Readmitted` follows
    /// once it is routed.
    Added {
        /// Its server URL.
        url: String,
        /// Regular, prefill or decode.
        worker_type: troupe_serving::inference::WorkerType,
        /// The host it runs on.
        host: usize,
    },
    /// A server is leaving the fleet (`Deployment::remove_server`): out of the router for new
    /// requests now; its in-flight requests finish before it stops.
    Draining {
        /// Its server URL.
        url: String,
        /// Requests in flight on it when it left the router.
        in_flight: usize,
    },
    /// A leaving server is stopped and its GPUs are free.
    Retired {
        /// Its server URL.
        url: String,
        /// Requests still in flight when it was stopped: 0 unless the drain timed out.
        cut: usize,
    },
    /// No host had room for an added server, so the cluster grew (on Slurm: one more job);
    /// the server goes there.
    HostsAdded {
        /// The unit the hosts came from (a Slurm job id).
        unit: String,
        /// Their indices in the cluster.
        hosts: Vec<usize>,
    },
    /// Hosts added for the fleet ran no server any more and were given back (on Slurm: the
    /// job was cancelled); their end is no host lost.
    HostsReleased {
        /// The unit given back (a Slurm job id).
        unit: String,
        /// Its hosts' indices.
        hosts: Vec<usize>,
    },
}
