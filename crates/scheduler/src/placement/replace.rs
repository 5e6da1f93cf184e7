//! Re-placing one server instance whose host was lost, under the rules of [`super::place`].
//!
//! It exists so a controller that loses a host does not re-implement placement: the new
//! bundle is cut by the same rule as the first one (adjacent GPUs of one host's list, or whole
//! hosts for an instance wider than a host; an engine relies on adjacent GPUs for NVLink pairs
//! and `--base-gpu-id` ranges), and the new ports come from the same cursor relay.

use std::collections::{BTreeMap, BTreeSet};

use super::pool::replacement_bundle;
use super::{PlacedInstance, Placement};
use crate::backend::WorkerType;
use crate::error::SchedulerError;
use crate::hosts::HostResources;
use crate::ports::PortAllocator;

/// What a re-placement must stay off: hosts that are gone and GPUs that are in use.
///
/// The caller says what is in use because only it knows what moved since the placement was
/// made (earlier re-placements); [`Placement::gpus_in_use`] is the starting point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Host indices ([`HostResources::index`]) that are lost: nothing goes there.
    pub lost: BTreeSet<usize>,
    /// GPU ids in use per host index (every component, training included).
    pub used: BTreeMap<usize, BTreeSet<u32>>,
}

impl Placement {
    /// The GPU ids every entry of this placement holds, per host index.
    pub fn gpus_in_use(&self) -> BTreeMap<usize, BTreeSet<u32>> {
        let mut used: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
        for e in &self.instances {
            used.entry(e.host)
                .or_default()
                .extend(e.gpus.iter().copied());
        }
        used
    }

    /// Where server instance `instance` of group `group` of component `component` runs again
    /// after its host was lost: one entry per node, of the same shape as now (worker type,
    /// GPUs per node, node count, which ports), on live hosts and free GPUs of `occupied`.
    ///
    /// The bundle follows the placement's rules: adjacent GPUs of one host's list for an
    /// instance on one host, the live host with the most free GPUs first (ties: the lowest
    /// index); whole free hosts of the same size for an instance wider than a host. The head
    /// gets fresh ports from `ports` (and every node the head's new dist-init address). This
    /// placement is not changed; on error neither is `ports`.
    pub fn replace(
        &self,
        component: usize,
        group: usize,
        instance: usize,
        hosts: &[HostResources],
        occupied: &Occupancy,
        ports: &mut PortAllocator,
    ) -> Result<Vec<PlacedInstance>, SchedulerError> {
        let mut old: Vec<&PlacedInstance> = self.instance(component, group, instance).collect();
        old.sort_by_key(|e| e.node_rank);
        let what = || format!("instance {instance} of group {group} of component {component}");
        let Some(head) = old.first().copied() else {
            return Err(SchedulerError::Unknown {
                what: "instance".into(),
                detail: format!(
                    "{} is not placed; there are {} placed processes",
                    what(),
                    self.instances.len()
                ),
            });
        };
        if head.worker_type == WorkerType::Train {
            return Err(SchedulerError::Unknown {
                what: "server instance".into(),
                detail: format!(
                    "{} is a training rank; only server instances are re-placed",
                    what()
                ),
            });
        }
        let per_node: Vec<usize> = old.iter().map(|e| e.gpus.len()).collect();
        let describe = || format!("the lost {}", what());
        let bundle =
            replacement_bundle(hosts, &occupied.lost, &occupied.used, &per_node, &describe)?;
        let Some((head_pos, _)) = bundle.first() else {
            return Err(SchedulerError::Unknown {
                what: "instance".into(),
                detail: format!("{} has no node", what()),
            });
        };
        let new_head = &hosts[*head_pos];
        let mut alloc = ports.clone();
        let fresh = alloc.take_ports(new_head, head.ports.needs())?;
        let dist_init_addr = fresh.dist.map(|p| format!("{}:{p}", new_head.address));
        let nnodes = u32::try_from(bundle.len()).unwrap_or(u32::MAX);
        let placed = bundle
            .into_iter()
            .enumerate()
            .map(|(rank, (pos, gpus))| PlacedInstance {
                component,
                group,
                instance,
                worker_type: head.worker_type,
                host: hosts[pos].index,
                gpus,
                ports: if rank == 0 { fresh } else { Default::default() },
                address: hosts[pos].address.clone(),
                node_rank: u32::try_from(rank).unwrap_or(u32::MAX),
                nnodes,
                dist_init_addr: dist_init_addr.clone(),
            })
            .collect();
        *ports = alloc;
        Ok(placed)
    }
}
