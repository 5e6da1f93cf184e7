//! The resources a host advertises, as placement sees them.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::SchedulerError;

/// One actor host: where it is reachable and which GPUs it offers.
///
/// It exists so placement does not depend on the runtime's own host descriptions; the runtime
/// converts its hosts into this. GPU ids are listed in the order bundles are cut from
/// (an instance's GPUs are contiguous in this list).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostResources {
    /// Host index (node rank order); placement reports this in `host`.
    pub index: usize,
    /// Address other hosts reach it at (used for `dist_init_addr`).
    pub address: String,
    /// GPU ids in allocation order, as `CUDA_VISIBLE_DEVICES` would name them.
    pub gpu_ids: Vec<u32>,
    /// CPU cores (informational).
    #[serde(default)]
    pub cpus: u32,
    /// Memory in bytes (informational).
    #[serde(default)]
    pub memory_bytes: u64,
}

impl HostResources {
    /// A host with the given index, address and GPU ids.
    pub fn new(index: usize, address: impl Into<String>, gpu_ids: Vec<u32>) -> Self {
        HostResources {
            index,
            address: address.into(),
            gpu_ids,
            cpus: 0,
            memory_bytes: 0,
        }
    }

    /// `count` identical hosts `host0`, `host1`, … with GPUs `0..gpus_per_host` each; used by
    /// `troupe alloc --hosts` and tests.
    pub fn uniform(count: usize, gpus_per_host: u32) -> Vec<HostResources> {
        (0..count)
            .map(|i| HostResources::new(i, format!("host{i}"), (0..gpus_per_host).collect()))
            .collect()
    }
}

/// Checks a host list: non-empty, unique indices, non-empty addresses, unique GPU ids per host.
pub(crate) fn validate_hosts(hosts: &[HostResources]) -> Result<(), SchedulerError> {
    let example =
        "HostResources { index: 0, address: \"10.0.0.1\", gpu_ids: vec![0, 1, 2, 3], .. }";
    let err = |message: String| SchedulerError::Hosts {
        message,
        example: example.to_string(),
    };
    if hosts.is_empty() {
        return Err(err(
            "no hosts were given; placement needs at least one".into()
        ));
    }
    let mut indices = BTreeSet::new();
    for host in hosts {
        if !indices.insert(host.index) {
            return Err(err(format!("host index {} appears twice", host.index)));
        }
        if host.address.trim().is_empty() {
            return Err(err(format!("host {} has an empty address", host.index)));
        }
        let mut gpus = BTreeSet::new();
        if let Some(dup) = host.gpu_ids.iter().find(|g| !gpus.insert(**g)) {
            return Err(err(format!(
                "host {} lists GPU {dup} twice in gpu_ids",
                host.index
            )));
        }
    }
    Ok(())
}
