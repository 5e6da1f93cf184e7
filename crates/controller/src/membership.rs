//! Host membership: one watcher per host turns its event stream into cluster events and
//! declares the host lost when the stream breaks or heartbeats stop.
//!
//! A killed host is noticed at once (its TCP connection resets); a hung or partitioned one
//! within `lost_after` of its last heartbeat. A host in the controller's own process is never
//! lost by silence: it lives and dies with the process, and a silence there only means the
//! process was busy. Either way every pending call on it fails with
//! `HostLost` right then, so no caller waits on a dead host.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::broadcast;
use tokio::time::Instant;
use troupe_wire::v1::host_event::Event;

use crate::conn::HostConn;
use crate::event_stream::EventStream;

/// Something that happened in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterEvent {
    /// The host stopped answering (process died, heartbeats stopped, connection lost).
    HostLost {
        /// Index of the host in the cluster.
        host: usize,
        /// The host's id.
        host_id: String,
        /// What was observed.
        reason: String,
    },
    /// An actor started.
    ActorStarted {
        /// The host's id.
        host_id: String,
        /// The actor's id.
        actor_id: String,
        /// Its kind.
        kind: String,
        /// Its name.
        name: String,
    },
    /// An actor stopped (on request, or killed after its grace period).
    ActorStopped {
        /// The host's id.
        host_id: String,
        /// The actor's id.
        actor_id: String,
        /// Why.
        reason: String,
    },
    /// An actor failed for good (no restarts left, or a restart failed).
    ActorFailed {
        /// The host's id.
        host_id: String,
        /// The actor's id.
        actor_id: String,
        /// Why.
        reason: String,
    },
    /// An actor failed and will be restarted after `delay` (sent at once, before the restart).
    ActorRestarting {
        /// The host's id.
        host_id: String,
        /// The actor's id.
        actor_id: String,
        /// Which restart this will be.
        count: u32,
        /// Why it failed.
        reason: String,
        /// Back-off before the restart.
        delay: Duration,
    },
    /// An actor failed and was restarted.
    ActorRestarted {
        /// The host's id.
        host_id: String,
        /// The actor's id.
        actor_id: String,
        /// Restarts so far.
        count: u32,
        /// Why it failed.
        reason: String,
    },
}

/// Watches one host until it is lost or the cluster closes. `same_process`: the host runs in
/// this process (an in-process launcher's, over gRPC), so silence does not make it lost.
pub(crate) async fn watch_host(
    index: usize,
    conn: Arc<HostConn>,
    opened: Result<EventStream, String>,
    events: broadcast::Sender<ClusterEvent>,
    (lost_after, same_process): (Duration, bool),
    closing: Arc<AtomicBool>,
) {
    let reason = match opened {
        Err(e) => format!("cannot watch host: {e}"),
        Ok(mut stream) => {
            let in_process = same_process || conn.in_process();
            let mut deadline = Instant::now() + lost_after;
            loop {
                tokio::select! {
                    ev = stream.next() => match ev {
                        Some(Ok(e)) => {
                            deadline = Instant::now() + lost_after;
                            if let Some(ce) = to_cluster_event(&e.host_id, e.event) {
                                let _ = events.send(ce);
                            }
                        }
                        Some(Err(s)) => break format!("event stream failed: {s}"),
                        None => break "event stream ended (host shut down or connection closed)".to_string(),
                    },
                    // A host in this process shares its fate: its heartbeats stop only when
                    // the process is too busy to deliver them (one request hogging the
                    // runtime), never because the host is gone, so only a real host's silence
                    // counts. Its end comes as the stream's end.
                    _ = tokio::time::sleep_until(deadline), if !in_process => {
                        break format!("no heartbeat for {lost_after:?}");
                    }
                }
            }
        }
    };
    if closing.load(Ordering::Acquire) {
        conn.mark_lost("cluster shut down");
        return;
    }
    if conn.mark_lost(&reason) {
        tracing::warn!(host = %conn.host_id, %reason, "host lost");
        let _ = events.send(ClusterEvent::HostLost {
            host: index,
            host_id: conn.host_id.clone(),
            reason,
        });
    }
}

fn to_cluster_event(host_id: &str, e: Option<Event>) -> Option<ClusterEvent> {
    let host_id = host_id.to_string();
    Some(match e? {
        Event::Started(s) => {
            let a = s.actor?;
            ClusterEvent::ActorStarted {
                host_id,
                actor_id: a.actor_id,
                kind: a.kind,
                name: a.name,
            }
        }
        Event::Stopped(s) => ClusterEvent::ActorStopped {
            host_id,
            actor_id: s.actor_id,
            reason: s.reason,
        },
        Event::Failed(f) => ClusterEvent::ActorFailed {
            host_id,
            actor_id: f.actor_id,
            reason: f.reason,
        },
        Event::Restarted(r) => ClusterEvent::ActorRestarted {
            host_id,
            actor_id: r.actor_id,
            count: r.count,
            reason: r.reason,
        },
        Event::Restarting(r) => ClusterEvent::ActorRestarting {
            host_id,
            actor_id: r.actor_id,
            count: r.count,
            reason: r.reason,
            delay: Duration::from_millis(r.delay_ms),
        },
        Event::Heartbeat(_) => return None,
    })
}
