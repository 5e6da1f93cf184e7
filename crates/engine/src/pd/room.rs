//! The prefill side's parking lot for KV handoffs, keyed by `bootstrap_room`.
//!
//! Either side may arrive first: the decode server often connects before the prefill has
//! finished. Each room is a `watch` channel that starts `Pending` and becomes `Ready` or
//! `Failed`; a room nobody fetches is dropped after the keep timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::KvHandoff;

/// State of one room.
#[derive(Debug, Clone)]
pub enum RoomState {
    /// The prefill has not finished yet.
    Pending,
    /// KV and first token are ready to fetch.
    Ready(Arc<KvHandoff>),
    /// The prefill failed or was aborted; the message goes to the decode side.
    Failed(String),
}

#[derive(Debug)]
struct Slot {
    tx: watch::Sender<RoomState>,
    created: Instant,
}

/// Rooms awaiting pickup.
#[derive(Debug)]
pub struct RoomStore {
    slots: Mutex<HashMap<u64, Slot>>,
    keep: Duration,
}

impl RoomStore {
    /// A store that drops unfetched rooms after `keep`.
    pub fn new(keep: Duration) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new(HashMap::new()),
            keep,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot_rx(&self, room: u64) -> watch::Receiver<RoomState> {
        let mut slots = self.lock();
        slots
            .entry(room)
            .or_insert_with(|| Slot {
                tx: watch::channel(RoomState::Pending).0,
                created: Instant::now(),
            })
            .tx
            .subscribe()
    }

    /// Publishes a room's outcome (called by the scheduler when a PD prefill finishes or fails).
    pub fn deposit(&self, room: u64, state: RoomState) {
        let mut slots = self.lock();
        let slot = slots.entry(room).or_insert_with(|| Slot {
            tx: watch::channel(RoomState::Pending).0,
            created: Instant::now(),
        });
        slot.created = Instant::now();
        slot.tx.send_replace(state);
    }

    /// Waits until the room is ready (or failed) and removes it. Errors say what happened.
    /// If the waiter goes away (the decode side disconnected) a still-pending room is removed.
    pub async fn take(&self, room: u64, timeout: Duration) -> Result<Arc<KvHandoff>, String> {
        let mut rx = self.slot_rx(room);
        let _guard = PendingGuard { store: self, room };
        let waited = tokio::time::timeout(timeout, async {
            loop {
                let state = rx.borrow_and_update().clone();
                match state {
                    RoomState::Pending => {
                        if rx.changed().await.is_err() {
                            return Err(format!("room {room} expired before the prefill finished"));
                        }
                    }
                    RoomState::Ready(h) => return Ok(h),
                    RoomState::Failed(m) => return Err(m),
                }
            }
        })
        .await;
        self.lock().remove(&room);
        match waited {
            Ok(r) => r,
            Err(_) => Err(format!(
                "room {room}: prefill did not deliver within {timeout:?}"
            )),
        }
    }

    fn remove_if_pending(&self, room: u64) {
        let mut slots = self.lock();
        if slots
            .get(&room)
            .is_some_and(|s| matches!(*s.tx.borrow(), RoomState::Pending))
        {
            slots.remove(&room);
        }
    }

    /// Drops rooms older than the keep timeout; returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let keep = self.keep;
        let mut slots = self.lock();
        let before = slots.len();
        slots.retain(|_, s| s.created.elapsed() < keep);
        before - slots.len()
    }

    /// Rooms currently held (ready, pending or failed).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no rooms are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes a room that is still pending when its waiter is dropped.
struct PendingGuard<'a> {
    store: &'a RoomStore,
    room: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.store.remove_if_pending(self.room);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KvCache, ModelConfig};

    fn handoff() -> KvHandoff {
        KvHandoff {
            input_ids: vec![1, 2],
            first_token: 3,
            first_logprob: -0.5,
            cache: KvCache::new(&ModelConfig::tiny()),
            cached_tokens: 0,
            kv_start: 0,
            weight_version: "v".into(),
        }
    }

    #[tokio::test]
    async fn either_side_may_come_first_and_rooms_expire() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let store = RoomStore::new(Duration::from_secs(60));
            store.deposit(1, RoomState::Ready(Arc::new(handoff())));
            assert_eq!(
                store
                    .take(1, Duration::from_secs(1))
                    .await
                    .unwrap()
                    .first_token,
                3
            );
            assert!(store.is_empty(), "a fetched room is gone");

            let waiter = {
                let store = store.clone();
                tokio::spawn(async move { store.take(2, Duration::from_secs(5)).await })
            };
            while store.is_empty() {
                tokio::task::yield_now().await;
            }
            store.deposit(2, RoomState::Failed("prefill aborted".into()));
            assert_eq!(waiter.await.unwrap().unwrap_err(), "prefill aborted");

            let err = store.take(3, Duration::from_millis(20)).await.unwrap_err();
            assert!(err.contains("did not deliver"), "{err}");
            assert!(
                store.is_empty(),
                "a timed-out waiter leaves no pending room"
            );

            let short = RoomStore::new(Duration::ZERO);
            short.deposit(4, RoomState::Ready(Arc::new(handoff())));
            assert_eq!(
                short.sweep(),
                1,
                "unfetched rooms are dropped after the keep time"
            );
        })
        .await
        .unwrap();
    }
}
