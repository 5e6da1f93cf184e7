//! Lifecycle events and heartbeats, fanned out to every `Watch` subscriber.
//!
//! One broadcast channel per host: a slow watcher loses old events (and is told so by lag),
//! never slows the host down.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use troupe_wire::v1::{self, host_event::Event};

/// Sends host events to all current watchers.
#[derive(Clone)]
pub(crate) struct EventBus {
    host_id: String,
    tx: broadcast::Sender<v1::HostEvent>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl EventBus {
    pub fn new(host_id: String) -> Self {
        let (tx, _) = broadcast::channel(4096);
        EventBus { host_id, tx }
    }

    pub fn event(&self, e: Event) -> v1::HostEvent {
        v1::HostEvent {
            host_id: self.host_id.clone(),
            unix_ms: unix_ms(),
            event: Some(e),
        }
    }

    pub fn emit(&self, e: Event) {
        let _ = self.tx.send(self.event(e));
    }

    pub fn subscribe(&self) -> broadcast::Receiver<v1::HostEvent> {
        self.tx.subscribe()
    }

    /// Emits a heartbeat every `interval` until `stop` is cancelled.
    pub fn spawn_heartbeats(
        &self,
        interval: Duration,
        live: impl Fn() -> u32 + Send + 'static,
        stop: CancellationToken,
    ) {
        let bus = self.clone();
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {
                        seq += 1;
                        bus.emit(heartbeat(seq, live(), interval));
                    }
                }
            }
        });
    }
}

/// A heartbeat event body.
pub(crate) fn heartbeat(seq: u64, live_actors: u32, interval: Duration) -> Event {
    Event::Heartbeat(v1::Heartbeat {
        seq,
        live_actors,
        interval_ms: interval.as_millis() as u64,
    })
}
