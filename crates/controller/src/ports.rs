//! The port ledger: which ports this controller has handed to servers, per machine.
//!
//! A port is claimed the moment the allocator takes it, so two deployments on one cluster (or
//! two forks at once) never pick the same port even before either server has bound it, which a
//! bind probe alone cannot see. Claims belong to a deployment ([`Claims`]) and are released at
//! its teardown, so a long-lived controller does not run out of ports. The ledger belongs to the
//! [`crate::Cluster`] ([`crate::Cluster::ports`]), which releases every claim at its shutdown;
//! deployments on other clusters are kept apart by the bind probe, the random start of each
//! deployment's port cursor and the ready check on the child's socket.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use troupe_scheduler::{HostResources, PortProbe};

/// Claimed `(machine, port)` pairs and which [`Claims`] holds each.
#[derive(Debug, Default)]
pub struct PortLedger {
    claimed: Mutex<BTreeMap<(String, u16), u64>>,
    next_id: AtomicU64,
}

impl PortLedger {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, u16), u64>> {
        self.claimed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new, empty set of claims (one per deployment).
    pub fn claims(self: &Arc<Self>) -> Arc<Claims> {
        Arc::new(Claims {
            ledger: self.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// How many ports are claimed now (by every deployment).
    pub fn claimed(&self) -> usize {
        self.lock().len()
    }

    /// Gives every claim back: the cluster shuts down, so none of its servers holds a port.
    pub fn release_all(&self) {
        self.lock().clear();
    }
}

/// One deployment's claims; released when [`Claims::release`] is called or the last reference
/// drops.
#[derive(Debug)]
pub struct Claims {
    ledger: Arc<PortLedger>,
    id: u64,
}

impl Claims {
    /// Claims `port` on `machine` for this deployment, whoever used it before (a recovered
    /// deployment re-claims the ports its servers hold).
    pub fn claim(&self, machine: &str, port: u16) {
        self.ledger
            .lock()
            .insert((machine.to_string(), port), self.id);
    }

    /// Claims `port` on `machine` if nobody holds it and `free` says it can be bound.
    fn try_claim(&self, machine: &str, port: u16, free: impl FnOnce() -> bool) -> bool {
        let mut claimed = self.ledger.lock();
        let key = (machine.to_string(), port);
        if claimed.contains_key(&key) || !free() {
            return false;
        }
        claimed.insert(key, self.id);
        true
    }

    /// Gives every port of this deployment back.
    pub fn release(&self) {
        self.ledger.lock().retain(|_, owner| *owner != self.id);
    }

    /// How many ports this deployment holds.
    pub fn len(&self) -> usize {
        self.ledger
            .lock()
            .values()
            .filter(|o| **o == self.id)
            .count()
    }

    /// Whether this deployment holds no port.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Claims {
    fn drop(&mut self) {
        self.release();
    }
}

/// The probe a deployment's port allocator uses: a bind probe when every host is this machine
/// (else assume free: a remote machine cannot be probed from here), plus the ledger.
#[derive(Debug)]
pub struct LedgerProbe {
    inner: Arc<dyn PortProbe>,
    claims: Arc<Claims>,
}

impl LedgerProbe {
    /// A probe over `hosts` that records what it hands out in `claims`.
    pub fn new(hosts: &[HostResources], claims: Arc<Claims>) -> Self {
        let all_local = hosts.iter().all(|h| h.address == "127.0.0.1");
        let inner: Arc<dyn PortProbe> = if all_local {
            Arc::new(troupe_scheduler::LocalBindProbe)
        } else {
            Arc::new(troupe_scheduler::AssumeFree)
        };
        LedgerProbe { inner, claims }
    }
}

impl PortProbe for LedgerProbe {
    fn is_free(&self, host: &HostResources, port: u16) -> bool {
        self.claims
            .try_claim(&host.address, port, || self.inner.is_free(host, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_exclude_each_other_and_are_released_at_teardown() {
        let ledger = Arc::new(PortLedger::default());
        let hosts = [HostResources::new(0, "10.0.0.9", vec![0])];
        let a = ledger.claims();
        let b = ledger.claims();
        let pa = LedgerProbe::new(&hosts, a.clone());
        let pb = LedgerProbe::new(&hosts, b.clone());
        assert!(pa.is_free(&hosts[0], 20000));
        assert!(!pb.is_free(&hosts[0], 20000), "claimed by a");
        assert!(pb.is_free(&hosts[0], 20001));
        assert_eq!((a.len(), b.len(), ledger.claimed()), (1, 1, 2));
        a.release();
        assert!(pb.is_free(&hosts[0], 20000), "released by a's teardown");
        drop(pa);
        drop(pb);
        assert_eq!(ledger.claimed(), 2, "b still holds its claims");
        drop(b);
        assert_eq!(
            ledger.claimed(),
            0,
            "the last reference to b's claims released them"
        );
    }
}
