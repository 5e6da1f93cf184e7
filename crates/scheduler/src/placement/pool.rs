//! GPU bundles: cutting contiguous GPU runs from hosts, or reusing a colocation target's GPUs.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::SchedulerError;
use crate::hosts::HostResources;

/// The GPUs of one instance: one `(host position, gpu ids)` per node; one entry unless the
/// instance spans hosts.
pub(crate) type Bundle = Vec<(usize, Vec<u32>)>;

/// Free GPUs per host. Bundles are always cut from the front of a host's remaining list, so the
/// free GPUs of a host are a suffix of its `gpu_ids` and every bundle is contiguous.
///
/// Free counts only shrink, so "host `p` has fewer than `k` free" and "host `p` is not whole"
/// stay true once true: the search hints below skip such hosts, which keeps placement linear in
/// hosts plus instances even for very large clusters.
pub(crate) struct GpuPool<'h> {
    hosts: &'h [HostResources],
    used: Vec<usize>,
    widest: usize,
    /// For a bundle size `k`, every host before this position has fewer than `k` free GPUs.
    fit_from: BTreeMap<usize, usize>,
    /// Every host before this position is partly used (or has no GPUs).
    whole_from: usize,
}

impl<'h> GpuPool<'h> {
    pub(crate) fn new(hosts: &'h [HostResources]) -> Self {
        GpuPool {
            hosts,
            used: vec![0; hosts.len()],
            widest: hosts.iter().map(|h| h.gpu_ids.len()).max().unwrap_or(0),
            fit_from: BTreeMap::new(),
            whole_from: 0,
        }
    }

    fn is_whole(&self, pos: usize) -> bool {
        self.used[pos] == 0 && !self.hosts[pos].gpu_ids.is_empty()
    }

    fn free(&self, pos: usize) -> usize {
        self.hosts[pos].gpu_ids.len().saturating_sub(self.used[pos])
    }

    fn cut(&mut self, pos: usize, k: usize) -> Vec<u32> {
        let start = self.used[pos];
        self.used[pos] += k;
        self.hosts[pos].gpu_ids[start..start + k].to_vec()
    }

    /// "5 free (host 0: 1, host 1: 4)", at most 16 hosts listed.
    pub(crate) fn describe_free(&self) -> String {
        describe_free(self.hosts, |p| Some(self.free(p)))
    }

    /// A fresh bundle of `k` GPUs: on the first host with `k` free GPUs, or, when `k` is wider
    /// than any host, on whole free hosts of equal size. `what` names the instance in errors.
    pub(crate) fn take(
        &mut self,
        k: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Bundle, SchedulerError> {
        if k <= self.widest {
            let from = self.fit_from.get(&k).copied().unwrap_or(0);
            let found = (from..self.hosts.len()).find(|&p| self.free(p) >= k);
            self.fit_from.insert(k, found.unwrap_or(self.hosts.len()));
            let Some(pos) = found else {
                return Err(self.no_room(what, k, "on one host".to_string()));
            };
            return Ok(vec![(pos, self.cut(pos, k))]);
        }
        self.take_whole_hosts(k, what)
    }

    fn take_whole_hosts(
        &mut self,
        k: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Bundle, SchedulerError> {
        let first = (self.whole_from..self.hosts.len()).find(|&p| self.is_whole(p));
        self.whole_from = first.unwrap_or(self.hosts.len());
        let Some(first) = first else {
            return Err(self.no_room(what, k, "on whole free hosts".to_string()));
        };
        let per_host = self.hosts[first].gpu_ids.len();
        if !k.is_multiple_of(per_host) {
            return Err(self.no_room(
                what,
                k,
                format!(
                    "on whole hosts (an instance wider than a host takes whole hosts, and {k} is \
                     not a multiple of {per_host} GPUs per host; pick t·p as a multiple of it)"
                ),
            ));
        }
        let nodes = k / per_host;
        let whole = (first..self.hosts.len()).filter(|&p| self.is_whole(p));
        let Some(chosen) = whole_hosts(self.hosts, whole, nodes, per_host) else {
            return Err(self.no_room(what, k, whole_hosts_shape(nodes, per_host)));
        };
        Ok(chosen
            .into_iter()
            .map(|p| (p, self.cut(p, per_host)))
            .collect())
    }

    fn no_room(&self, what: &dyn Fn() -> String, k: usize, shape: String) -> SchedulerError {
        SchedulerError::NoRoom {
            what: what(),
            needed: k as u64,
            shape,
            free: self.describe_free(),
        }
    }
}

/// "5 free (host 0: 1, host 1: 4)" over the hosts `free` counts (`None`: left out, e.g. a lost
/// host), at most 16 hosts listed.
fn describe_free(hosts: &[HostResources], free: impl Fn(usize) -> Option<usize>) -> String {
    let counted: Vec<(usize, usize)> = (0..hosts.len())
        .filter_map(|p| free(p).map(|f| (hosts[p].index, f)))
        .collect();
    let total: usize = counted.iter().map(|(_, f)| f).sum();
    let mut parts: Vec<String> = counted
        .iter()
        .take(16)
        .map(|(index, f)| format!("host {index}: {f}"))
        .collect();
    if counted.len() > 16 {
        parts.push(format!("… {} more hosts", counted.len() - 16));
    }
    format!("{total} free ({})", parts.join(", "))
}

/// The rule for an instance wider than a host: `nodes` whole free hosts of exactly `per_host`
/// GPUs, the first ones of `whole` (positions of whole free hosts, in host order); `None` when
/// there are not that many.
fn whole_hosts(
    hosts: &[HostResources],
    whole: impl Iterator<Item = usize>,
    nodes: usize,
    per_host: usize,
) -> Option<Vec<usize>> {
    let chosen: Vec<usize> = whole
        .filter(|&p| hosts[p].gpu_ids.len() == per_host)
        .take(nodes)
        .collect();
    (chosen.len() == nodes).then_some(chosen)
}

fn whole_hosts_shape(nodes: usize, per_host: usize) -> String {
    format!("on {nodes} whole free hosts of {per_host} GPUs")
}

/// The first run of `k` adjacent ids of a host's `gpu_ids` (its allocation order) none of which
/// is `taken`: the one-host bundle rule. [`GpuPool`] cuts from the front of a host's free
/// suffix, which is this run when nothing was ever given back.
fn adjacent_free(gpu_ids: &[u32], taken: &BTreeSet<u32>, k: usize) -> Option<Vec<u32>> {
    if k == 0 {
        return Some(Vec::new());
    }
    gpu_ids
        .windows(k)
        .find(|w| w.iter().all(|g| !taken.contains(g)))
        .map(<[u32]>::to_vec)
}

/// The bundle of a re-placed instance whose host was lost, of the same shape as before:
/// `per_node` holds its GPU count on each node (one entry for an instance on one host).
///
/// The placement's rules hold: an instance on one host gets `k` adjacent GPUs of one host's
/// list; an instance wider than a host gets whole free hosts of the same size as before. Among
/// the hosts that fit, a one-host instance goes to the live host with the most free GPUs (ties:
/// the lowest index), so re-placements spread over what survives; whole hosts are taken in host
/// order. Hosts in `lost` and GPUs in `used` (per host index) are never handed out.
pub(crate) fn replacement_bundle(
    hosts: &[HostResources],
    lost: &BTreeSet<usize>,
    used: &BTreeMap<usize, BTreeSet<u32>>,
    per_node: &[usize],
    what: &dyn Fn() -> String,
) -> Result<Bundle, SchedulerError> {
    let none = BTreeSet::new();
    let taken = |p: usize| used.get(&hosts[p].index).unwrap_or(&none);
    let live = |p: usize| !lost.contains(&hosts[p].index);
    let free = |p: usize| {
        hosts[p]
            .gpu_ids
            .iter()
            .filter(|g| !taken(p).contains(g))
            .count()
    };
    let k: usize = per_node.iter().sum();
    let no_room = |shape: String| SchedulerError::NoRoom {
        what: what(),
        needed: k as u64,
        shape,
        free: format!(
            "{} on live hosts",
            describe_free(hosts, |p| live(p).then(|| free(p)))
        ),
    };
    match per_node {
        [one] => {
            let best = (0..hosts.len())
                .filter(|&p| live(p))
                .filter_map(|p| {
                    Some((
                        free(p),
                        p,
                        adjacent_free(&hosts[p].gpu_ids, taken(p), *one)?,
                    ))
                })
                .max_by_key(|(f, p, _)| (*f, std::cmp::Reverse(*p)));
            match best {
                Some((_, p, gpus)) => Ok(vec![(p, gpus)]),
                None => Err(no_room("adjacent on one live host".to_string())),
            }
        }
        [per_host, ..] => {
            let whole = (0..hosts.len()).filter(|&p| {
                live(p) && !hosts[p].gpu_ids.is_empty() && free(p) == hosts[p].gpu_ids.len()
            });
            match whole_hosts(hosts, whole, per_node.len(), *per_host) {
                Some(chosen) => Ok(chosen
                    .into_iter()
                    .map(|p| (p, hosts[p].gpu_ids.clone()))
                    .collect()),
                None => Err(no_room(whole_hosts_shape(per_node.len(), *per_host))),
            }
        }
        [] => Err(no_room("(it has no node)".to_string())),
    }
}

/// The bundle of a colocated instance: GPUs `offset..offset+k` of the target's GPU sequence.
/// Like a fresh bundle it must lie on one host, or, when it spans hosts, cover each of them
/// whole (so a multi-node instance has the same share on every node).
pub(crate) fn colocated_bundle(
    hosts: &[HostResources],
    target: &[(usize, u32)],
    offset: usize,
    k: usize,
    what: &dyn Fn() -> String,
) -> Result<Bundle, SchedulerError> {
    let Some(chunk) = target.get(offset..offset.saturating_add(k)) else {
        return Err(SchedulerError::NoRoom {
            what: what(),
            needed: k as u64,
            shape: "from its colocation target".to_string(),
            free: format!("{} target GPUs", target.len()),
        });
    };
    let mut bundle: Bundle = Vec::new();
    for &(pos, gpu) in chunk {
        match bundle.last_mut() {
            Some((last, gpus)) if *last == pos => gpus.push(gpu),
            _ => bundle.push((pos, vec![gpu])),
        }
    }
    let mut distinct: Vec<usize> = bundle.iter().map(|(p, _)| *p).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let whole = bundle
        .iter()
        .all(|(p, g)| hosts.get(*p).is_some_and(|h| h.gpu_ids.len() == g.len()));
    if bundle.len() > 1 && !(whole && distinct.len() == bundle.len()) {
        let split: Vec<String> = bundle
            .iter()
            .map(|(p, g)| {
                let host = hosts.get(*p).map_or(*p, |h| h.index);
                format!("{} on host {host}", g.len())
            })
            .collect();
        return Err(SchedulerError::NoRoom {
            what: what(),
            needed: k as u64,
            shape: "on one host (or on whole hosts) of its colocation target".to_string(),
            free: format!(
                "the target's GPUs at this point split as {}; choose t·p so instances line up \
                 with the target's hosts",
                split.join(" + ")
            ),
        });
    }
    Ok(bundle)
}
