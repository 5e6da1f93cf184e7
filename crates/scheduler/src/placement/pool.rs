//! GPU bundles: cutting contiguous GPU runs from hosts, or reusing a colocation target's GPUs.

use std::collections::BTreeMap;

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
        let total: usize = (0..self.hosts.len()).map(|p| self.free(p)).sum();
        let mut parts: Vec<String> = (0..self.hosts.len())
            .take(16)
            .map(|p| format!("host {}: {}", self.hosts[p].index, self.free(p)))
            .collect();
        if self.hosts.len() > 16 {
            parts.push(format!("… {} more hosts", self.hosts.len() - 16));
        }
        format!("{total} free ({})", parts.join(", "))
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
        let chosen: Vec<usize> = (first..self.hosts.len())
            .filter(|&p| self.is_whole(p) && self.hosts[p].gpu_ids.len() == per_host)
            .take(nodes)
            .collect();
        if chosen.len() < nodes {
            return Err(self.no_room(
                what,
                k,
                format!("on {nodes} whole free hosts of {per_host} GPUs"),
            ));
        }
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
