//! Placement: every server instance and training rank of a plan gets a host, GPUs and ports.
//!
//! Rules: each server instance takes `t·p` GPUs contiguous in one host's GPU list (first host
//! with room, in host order); instances wider than a host take whole hosts and get a node rank
//! and the head's dist-init address; training ranks take one GPU each; components never share
//! GPUs unless colocated, and a colocated component reuses its target's GPUs in order. Ports come
//! from the per-host cursor relay ([`PortAllocator`]). A server instance whose host is lost is
//! placed again by [`Placement::replace`] under the same bundle rules.

mod pool;
mod replace;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use self::pool::{Bundle, GpuPool, colocated_bundle};
pub use self::replace::Occupancy;
use crate::backend::WorkerType;
use crate::error::SchedulerError;
use crate::hosts::{HostResources, validate_hosts};
use crate::plan::{AllocationPlan, Component, Group};
use crate::ports::{InstancePorts, PortAllocator, PortNeeds};

/// Knobs of placement that are not part of the allocation mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlacementOptions {
    /// Also give decode servers a bootstrap port (some SGLang transfer backends open one on the
    /// decode side too). Off by default: only prefill servers get one.
    pub decode_bootstrap_port: bool,
}

/// One launched process: a server instance on one node, or one training rank.
///
/// It exists so the launcher has everything it needs per process: where (host, GPUs), how to be
/// reached (ports), and how to join its peers (node rank, dist-init address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedInstance {
    /// Component index in the plan.
    pub component: usize,
    /// Group index in the component.
    pub group: usize,
    /// Instance index in the group (server index, or training rank).
    pub instance: usize,
    /// Regular, prefill, decode or train.
    pub worker_type: WorkerType,
    /// Host index ([`HostResources::index`]).
    pub host: usize,
    /// GPU ids on that host.
    pub gpus: Vec<u32>,
    /// Ports bound on that host; only the head node of a server / rank 0 of training has any.
    pub ports: InstancePorts,
    /// Address of the host.
    pub address: String,
    /// Node rank within a multi-node server, or host ordinal among a training group's hosts.
    pub node_rank: u32,
    /// Nodes of the server, or hosts of the training group.
    pub nnodes: u32,
    /// `head_address:dist_port` used to rendezvous.
    pub dist_init_addr: Option<String>,
}

/// Where everything of a plan runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Entries sorted by component, group, instance, node rank.
    pub instances: Vec<PlacedInstance>,
}

fn describe(plan: &AllocationPlan, c: usize, g: usize, group: &Group, i: u64) -> String {
    let label = plan
        .components
        .get(c)
        .map(Component::label)
        .unwrap_or_default();
    format!(
        "instance {i} of the {} group {g} of component {c} (`{label}`)",
        group.worker_type
    )
}

/// Places `plan` on `hosts`, taking ports from `ports`. On error nothing changes in `ports`.
pub fn place(
    plan: &AllocationPlan,
    hosts: &[HostResources],
    ports: &mut PortAllocator,
    options: &PlacementOptions,
) -> Result<Placement, SchedulerError> {
    validate_hosts(hosts)?;
    plan.validate()?;
    let needed = plan.world_size();
    let available = hosts
        .iter()
        .fold(0u64, |acc, h| acc.saturating_add(h.gpu_ids.len() as u64));
    if needed > available {
        return Err(SchedulerError::NotEnoughGpus {
            needed,
            available,
            hosts: hosts.len(),
        });
    }
    let mut pool = GpuPool::new(hosts);
    let mut alloc = ports.clone();
    let mut sequences: BTreeMap<usize, Vec<(usize, u32)>> = BTreeMap::new();
    let mut out = Vec::new();
    let (owners, members): (Vec<usize>, Vec<usize>) =
        (0..plan.components.len()).partition(|&c| plan.components[c].colocate_with.is_none());
    for c in owners.into_iter().chain(members) {
        let component = &plan.components[c];
        let target = component
            .colocate_with
            .as_deref()
            .and_then(|name| plan.component_index(name))
            .and_then(|t| sequences.get(&t).cloned());
        let mut sequence = Vec::new();
        for (g, group) in component.groups.iter().enumerate() {
            let k = usize::try_from(group.gpus_per_instance()).unwrap_or(usize::MAX);
            let mut bundles = Vec::new();
            for i in 0..group.instances() {
                let what = || describe(plan, c, g, group, i);
                let bundle = match &target {
                    Some(seq) => colocated_bundle(hosts, seq, sequence.len(), k, &what)?,
                    None => pool.take(k, &what)?,
                };
                for (pos, gpus) in &bundle {
                    sequence.extend(gpus.iter().map(|gpu| (*pos, *gpu)));
                }
                bundles.push(bundle);
            }
            let ids = (c, g);
            if group.worker_type == WorkerType::Train {
                emit_ranks(hosts, ids, &bundles, &mut alloc, &mut out)?;
            } else {
                let needs = PortNeeds {
                    http: true,
                    dist: true,
                    bootstrap: group.worker_type == WorkerType::Prefill
                        || (group.worker_type == WorkerType::Decode
                            && options.decode_bootstrap_port),
                };
                emit_servers(
                    hosts,
                    ids,
                    group.worker_type,
                    needs,
                    &bundles,
                    &mut alloc,
                    &mut out,
                )?;
            }
        }
        sequences.insert(c, sequence);
    }
    out.sort_by_key(|e| (e.component, e.group, e.instance, e.node_rank));
    *ports = alloc;
    Ok(Placement { instances: out })
}

fn emit_servers(
    hosts: &[HostResources],
    (component, group): (usize, usize),
    worker_type: WorkerType,
    needs: PortNeeds,
    bundles: &[Bundle],
    alloc: &mut PortAllocator,
    out: &mut Vec<PlacedInstance>,
) -> Result<(), SchedulerError> {
    for (instance, bundle) in bundles.iter().enumerate() {
        let Some((head_pos, _)) = bundle.first() else {
            continue;
        };
        let head = &hosts[*head_pos];
        let ports = alloc.take_ports(head, needs)?;
        let dist_init_addr = ports.dist.map(|p| format!("{}:{p}", head.address));
        let nnodes = u32::try_from(bundle.len()).unwrap_or(u32::MAX);
        for (rank, (pos, gpus)) in bundle.iter().enumerate() {
            out.push(PlacedInstance {
                component,
                group,
                instance,
                worker_type,
                host: hosts[*pos].index,
                gpus: gpus.clone(),
                ports: if rank == 0 {
                    ports
                } else {
                    InstancePorts::default()
                },
                address: hosts[*pos].address.clone(),
                node_rank: u32::try_from(rank).unwrap_or(u32::MAX),
                nnodes,
                dist_init_addr: dist_init_addr.clone(),
            });
        }
    }
    Ok(())
}

fn emit_ranks(
    hosts: &[HostResources],
    (component, group): (usize, usize),
    bundles: &[Bundle],
    alloc: &mut PortAllocator,
    out: &mut Vec<PlacedInstance>,
) -> Result<(), SchedulerError> {
    // Host ordinal (node rank) of each host position, in order of first use.
    let mut node_of: BTreeMap<usize, u32> = BTreeMap::new();
    for bundle in bundles {
        for (pos, _) in bundle {
            let next = u32::try_from(node_of.len()).unwrap_or(u32::MAX);
            node_of.entry(*pos).or_insert(next);
        }
    }
    let Some(head_pos) = bundles.first().and_then(|b| b.first()).map(|(p, _)| *p) else {
        return Ok(());
    };
    let head = &hosts[head_pos];
    let dist = alloc.take_ports(
        head,
        PortNeeds {
            dist: true,
            ..PortNeeds::default()
        },
    )?;
    let dist_init_addr = dist.dist.map(|p| format!("{}:{p}", head.address));
    let nnodes = u32::try_from(node_of.len()).unwrap_or(u32::MAX);
    for (rank, bundle) in bundles.iter().enumerate() {
        for (pos, gpus) in bundle {
            let node_rank = node_of.get(pos).copied().unwrap_or(0);
            out.push(PlacedInstance {
                component,
                group,
                instance: rank,
                worker_type: WorkerType::Train,
                host: hosts[*pos].index,
                gpus: gpus.clone(),
                ports: if rank == 0 {
                    dist
                } else {
                    InstancePorts::default()
                },
                address: hosts[*pos].address.clone(),
                node_rank,
                nnodes,
                dist_init_addr: dist_init_addr.clone(),
            });
        }
    }
    Ok(())
}

impl Placement {
    /// The entries (one per node) of one instance.
    pub fn instance(
        &self,
        component: usize,
        group: usize,
        instance: usize,
    ) -> impl Iterator<Item = &PlacedInstance> {
        self.instances
            .iter()
            .filter(move |e| e.component == component && e.group == group && e.instance == instance)
    }

    /// Entries of the server heads and training rank 0s: the processes that own ports.
    pub fn heads(&self) -> impl Iterator<Item = &PlacedInstance> {
        self.instances.iter().filter(|e| !e.ports.all().is_empty())
    }

    /// Gives an instance fresh ports after its launcher hit `EADDRINUSE`, and updates the
    /// dist-init address of every process that rendezvouses with it. Returns the new ports.
    pub fn reassign_ports(
        &mut self,
        component: usize,
        group: usize,
        instance: usize,
        hosts: &[HostResources],
        ports: &mut PortAllocator,
    ) -> Result<InstancePorts, SchedulerError> {
        let Some(head) = self.instances.iter().position(|e| {
            e.component == component
                && e.group == group
                && e.instance == instance
                && !e.ports.all().is_empty()
        }) else {
            return Err(SchedulerError::Unknown {
                what: "instance".into(),
                detail: format!(
                    "component {component} group {group} instance {instance} is not placed or \
                     owns no ports (followers of a multi-node server and training ranks > 0 use \
                     their head's ports); there are {} placed processes",
                    self.instances.len()
                ),
            });
        };
        let entry = &self.instances[head];
        let Some(host) = hosts.iter().find(|h| h.index == entry.host) else {
            return Err(SchedulerError::Unknown {
                what: "host".into(),
                detail: format!("host {} is not in the host list given", entry.host),
            });
        };
        let fresh = ports.replace(host, &entry.ports)?;
        let old_addr = entry.dist_init_addr.clone();
        let new_addr = fresh.dist.map(|p| format!("{}:{p}", host.address));
        self.instances[head].ports = fresh;
        if old_addr.is_some() {
            for e in &mut self.instances {
                if e.component == component && e.group == group && e.dist_init_addr == old_addr {
                    e.dist_init_addr.clone_from(&new_addr);
                }
            }
        }
        Ok(fresh)
    }
}
