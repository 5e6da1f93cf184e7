//! What the plane's operation lock guards ([`OpState`]): the weight groups clients opened
//! through the plane and the last update that came through it. The plane holds it, the weight
//! updates (`super::updates`) write it and the catch-up replays from it, so it lives below
//! them.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::Value;

use crate::engines::Engine;

/// Mutable state behind the operation lock.
#[derive(Default)]
pub(crate) struct OpState {
    /// Weight groups a client (rank 0) opened through the plane, by name.
    pub(crate) groups: HashMap<String, ClientGroup>,
    /// The last weight update that came through the plane (catch-up replays it).
    pub(crate) last: Option<LastUpdate>,
    /// A client's update between `BeginWeightUpdate` and `EndWeightUpdate`
    /// (`super::client_txn`).
    pub(crate) txn: Option<ClientTxn>,
}

/// A weight group a client opened through the plane.
#[derive(Debug, Clone)]
pub(crate) struct ClientGroup {
    /// Engines in the group, each with its first rank.
    pub(crate) members: Vec<(Engine, u32)>,
}

/// The last update that came through the plane.
#[derive(Debug, Clone)]
pub(crate) enum LastUpdate {
    /// Tensors pushed by the plane's own weight sync (it keeps the bytes).
    Tensors,
    /// A file every engine loaded (the request body, replayable).
    Disk(Value),
    /// A client's own broadcast: not replayable.
    Broadcast,
}

/// An open client update, between `begin_update` and `end_update` (`super::client_txn`).
#[derive(Debug, Default)]
pub(crate) struct ClientTxn {
    /// Engines (by URL) that stage its buckets.
    pub(crate) staged: HashSet<String>,
    /// Every engine a bucket reached, by URL.
    pub(crate) reached: BTreeMap<String, Engine>,
    /// Buckets every member took.
    pub(crate) buckets: u64,
    /// The version its buckets named (the last one that named one).
    pub(crate) version: Option<troupe_wire::WeightVersion>,
    /// Why it ended early, once a bucket failed: nothing of it is served.
    pub(crate) failed: Option<String>,
}

impl ClientTxn {
    /// Whether the bucket for `url` is staged.
    pub(crate) fn stages(&self, url: &str) -> bool {
        self.staged.contains(url)
    }
}
