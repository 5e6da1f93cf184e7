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
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc};
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

/// Where the hosts' watchers send cluster events: one broadcast channel for every subscriber
/// that may miss some (a receiver that lags past its capacity loses the oldest), and one
/// unbounded queue per [`MembershipEvents`] subscriber, which loses none. Bring-up alone
/// reports an event per actor started, so with thousands of servers a receiver that reads only
/// after bring-up, as the serving watcher does, would lag past any fixed capacity.
#[derive(Debug, Clone)]
pub(crate) struct EventSinks {
    all: broadcast::Sender<ClusterEvent>,
    lossless: Arc<Mutex<Vec<mpsc::UnboundedSender<ClusterEvent>>>>,
}

impl EventSinks {
    /// Sinks whose broadcast channel holds `capacity` events per lagging receiver.
    pub(crate) fn new(capacity: usize) -> Self {
        EventSinks {
            all: broadcast::channel(capacity).0,
            lossless: Arc::default(),
        }
    }

    /// Sends `e` to every subscriber (lossless ones whose receiver is gone are dropped).
    pub(crate) fn send(&self, e: ClusterEvent) {
        self.lossless.lock().retain(|s| s.send(e.clone()).is_ok());
        let _ = self.all.send(e);
    }

    /// A broadcast receiver: it may lag (`RecvError::Lagged`) if it reads too slowly.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<ClusterEvent> {
        self.all.subscribe()
    }

    /// A receiver that gets every event sent from now on, however late it reads.
    pub(crate) fn subscribe_lossless(&self) -> MembershipEvents {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lossless.lock().push(tx);
        MembershipEvents(rx)
    }
}

/// Every cluster event from the subscription on, none lost however late they are read
/// (`Cluster::membership_events`): what reacts to hosts and actors lost must see each one.
#[derive(Debug)]
pub struct MembershipEvents(mpsc::UnboundedReceiver<ClusterEvent>);

impl MembershipEvents {
    /// The next event; `None` once the cluster is gone.
    pub async fn recv(&mut self) -> Option<ClusterEvent> {
        self.0.recv().await
    }
}

/// Watches one host until it is lost or the cluster closes. `same_process`: the host runs in
/// this process (an in-process launcher's, over gRPC), so silence does not make it lost.
pub(crate) async fn watch_host(
    index: usize,
    conn: Arc<HostConn>,
    opened: Result<EventStream, String>,
    events: EventSinks,
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
                                events.send(ce);
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
        events.send(ClusterEvent::HostLost {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn started(i: usize) -> ClusterEvent {
        ClusterEvent::ActorStarted {
            host_id: "h".into(),
            actor_id: format!("a{i}"),
            kind: "k".into(),
            name: format!("n{i}"),
        }
    }

    #[tokio::test]
    async fn a_late_reader_of_membership_events_loses_none_where_a_broadcast_one_lags() {
        tokio::time::timeout(Duration::from_secs(30), late_reader())
            .await
            .expect("in time");
    }

    async fn late_reader() {
        let sinks = EventSinks::new(4096);
        let mut lagging = sinks.subscribe();
        let mut late = sinks.subscribe_lossless();
        // A bring-up of 4,096 servers reports more actors started than the broadcast holds,
        // before the serving watcher reads its first event; then a host is lost.
        for i in 0..5000 {
            sinks.send(started(i));
        }
        let lost = ClusterEvent::HostLost {
            host: 3,
            host_id: "h3".into(),
            reason: "gone".into(),
        };
        sinks.send(lost.clone());
        assert!(matches!(
            lagging.recv().await,
            Err(broadcast::error::RecvError::Lagged(_))
        ));
        for i in 0..5000 {
            assert_eq!(late.recv().await, Some(started(i)));
        }
        assert_eq!(late.recv().await, Some(lost));
        drop(sinks);
        assert_eq!(late.recv().await, None, "the cluster gone ends the stream");
    }
}
