//! Outgrowing the allocation: when no host has room for a server the fleet adds, the
//! deployment asks the cluster for more hosts (`crate::grow`: on Slurm, one more job of the
//! nodes the server needs, with the first job's options), places the server there, and gives
//! those hosts back once no server of the deployment runs on them (on Slurm: `scancel`), or
//! at teardown. Which unit (job) each added host came from is kept here, per deployment.

use troupe_scheduler::{HostResources, SchedulerError};

use super::addr::machine;
use super::instances::{Instance, Lifecycle};
use super::replace::{ReplaceError, Replacer, lock};

/// Hosts added for a server ([`Replacer::outgrow`]).
pub(crate) struct Outgrown {
    /// The unit they came from (a Slurm job id).
    pub unit: String,
    /// Their indices in the cluster.
    pub hosts: Vec<usize>,
}

impl ReplaceError {
    /// True when the scheduler found no free GPUs of the shape asked for: more hosts would
    /// help.
    pub(crate) fn no_room(&self) -> bool {
        matches!(self, ReplaceError::Scheduler(SchedulerError::NoRoom { .. }))
    }
}

impl Replacer {
    /// Adds the hosts a server like `template` needs (one node: multi-node servers are not
    /// added) as one unit, and makes them candidates for placement.
    pub(crate) async fn outgrow(&self, template: &Instance) -> Result<Outgrown, String> {
        let nodes = 1 + template.others.len();
        let (unit, hosts) = self.growth.grow(nodes).await.map_err(|e| e.to_string())?;
        let indices: Vec<usize> = hosts.iter().map(|h| h.index()).collect();
        {
            let mut res = lock(&self.resources);
            res.extend(hosts.iter().map(|h| {
                HostResources::new(h.index(), machine(h.address()), h.gpu_ids().to_vec())
            }));
            lock(&self.hosts).extend(hosts);
        }
        lock(&self.grown).insert(unit.clone(), indices.clone());
        Ok(Outgrown {
            unit,
            hosts: indices,
        })
    }

    /// Gives back every added unit none of whose hosts runs (or is launching) a live server
    /// of this deployment: taken out of placement first, then released. What was given back.
    pub(crate) async fn release_idle(&self) -> Vec<Outgrown> {
        let _placing = self.placing.write().await;
        let idle: Vec<Outgrown> = {
            // Under the lock placement picks GPUs under: no launch picks these hosts now.
            let launching = lock(&self.launching);
            let live = self.instances.live();
            let busy = |h: usize| {
                launching.get(&h).is_some_and(|g| !g.is_empty())
                    || live
                        .iter()
                        .filter(|i| i.life != Lifecycle::Removed)
                        .any(|i| i.hosts().contains(&h))
            };
            let mut grown = lock(&self.grown);
            let units: Vec<String> = grown
                .iter()
                .filter(|(_, hosts)| !hosts.iter().any(|&h| busy(h)))
                .map(|(u, _)| u.clone())
                .collect();
            let out: Vec<Outgrown> = units
                .into_iter()
                .filter_map(|u| {
                    let hosts = grown.remove(&u)?;
                    Some(Outgrown { unit: u, hosts })
                })
                .collect();
            for o in &out {
                lock(&self.hosts).retain(|h| !o.hosts.contains(&h.index()));
                lock(&self.resources).retain(|r| !o.hosts.contains(&r.index));
            }
            out
        };
        for o in &idle {
            if let Err(e) = self.growth.release(&o.unit).await {
                tracing::warn!(unit = %o.unit, "cannot give added hosts back: {e}");
            }
        }
        idle
    }

    /// Gives back every unit added for this deployment (teardown, after its servers stopped).
    pub(crate) async fn release_all(&self) {
        let units: Vec<String> = std::mem::take(&mut *lock(&self.grown))
            .into_keys()
            .collect();
        for u in units {
            if let Err(e) = self.growth.release(&u).await {
                tracing::warn!(unit = %u, "cannot give added hosts back: {e}");
            }
        }
    }
}
