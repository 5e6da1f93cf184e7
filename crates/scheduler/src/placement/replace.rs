//! Re-placing one instance whose host was lost, under the same bundle rule as [`super::place`]:
//! a bundle is a contiguous run of one host's GPU ids.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::SchedulerError;
use crate::hosts::HostResources;

/// Where a lost instance of `need` GPUs can run again: the live host (not in `lost`) with the
/// most free GPUs among those that have a contiguous run of `need` free ones (ties: the lowest
/// index), and that run. `used` holds the GPU ids in use per host index (every component,
/// training included). An instance of no GPUs goes to the live host with the most free GPUs.
///
/// It exists so the controller's re-placement keeps the placement's rules instead of
/// re-implementing them: a bundle cut from the middle of holes would hand an engine GPUs that
/// are not adjacent, which multi-GPU engines (NVLink pairs, `--base-gpu-id` ranges) rely on.
pub fn replacement_bundle(
    hosts: &[HostResources],
    used: &BTreeMap<usize, BTreeSet<u32>>,
    lost: &BTreeSet<usize>,
    need: usize,
) -> Result<(usize, Vec<u32>), SchedulerError> {
    let none = BTreeSet::new();
    let best = hosts
        .iter()
        .filter(|h| !lost.contains(&h.index))
        .filter_map(|h| {
            let taken = used.get(&h.index).unwrap_or(&none);
            let free = h.gpu_ids.iter().filter(|g| !taken.contains(g)).count();
            let run = contiguous_free(&h.gpu_ids, taken, need)?;
            Some((free, h.index, run))
        })
        .max_by_key(|(free, index, _)| (*free, std::cmp::Reverse(*index)));
    match best {
        Some((_, index, run)) => Ok((index, run)),
        None => {
            let free: usize = hosts
                .iter()
                .filter(|h| !lost.contains(&h.index))
                .map(|h| {
                    let taken = used.get(&h.index).unwrap_or(&none);
                    h.gpu_ids.iter().filter(|g| !taken.contains(g)).count()
                })
                .sum();
            Err(SchedulerError::NoRoom {
                what: "the lost instance".into(),
                needed: need as u64,
                shape: "contiguous on one live host".into(),
                free: format!("{free} free on live hosts"),
            })
        }
    }
}

/// The first run of `need` adjacent ids of `gpu_ids` (in the host's order) none of which is
/// taken.
fn contiguous_free(gpu_ids: &[u32], taken: &BTreeSet<u32>, need: usize) -> Option<Vec<u32>> {
    if need == 0 {
        return Some(Vec::new());
    }
    gpu_ids
        .windows(need)
        .find(|w| w.iter().all(|g| !taken.contains(g)))
        .map(<[u32]>::to_vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(pairs: &[(usize, &[u32])]) -> BTreeMap<usize, BTreeSet<u32>> {
        pairs
            .iter()
            .map(|(h, g)| (*h, g.iter().copied().collect()))
            .collect()
    }

    #[test]
    fn takes_a_contiguous_run_on_the_freest_live_host() {
        let hosts = HostResources::uniform(3, 4);
        // Host 0 has 2 free but not adjacent (1 and 3); host 1 has 0 and 1 free; host 2 is lost.
        let u = used(&[(0, &[0, 2]), (1, &[2, 3])]);
        let lost: BTreeSet<usize> = [2].into();
        assert_eq!(
            replacement_bundle(&hosts, &u, &lost, 2).unwrap(),
            (1, vec![0, 1])
        );
        // One GPU: both hosts have 2 free; the lower index wins.
        assert_eq!(
            replacement_bundle(&hosts, &u, &lost, 1).unwrap(),
            (0, vec![1])
        );
        // Nothing fits three.
        assert!(replacement_bundle(&hosts, &u, &lost, 3).is_err());
        // No GPUs needed: the freest live host.
        assert_eq!(
            replacement_bundle(&hosts, &u, &lost, 0).unwrap(),
            (0, vec![])
        );
    }
}
