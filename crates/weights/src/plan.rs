//! Who is which rank in the weight-update group(s): the only thing the trainer needs to know.
//!
//! The trainer's rank 0 broadcasts; every engine's GPUs (prefill and decode alike) receive.
//! Ranks are handed out cumulatively in engine order (DESIGN.md section 8):
//!
//! ```text
//! world_size     = 1 + sum_i gpus(i)
//! rank_offset(i) = 1 + sum_{j<i} gpus(j)      // engine i's GPUs are ranks offset .. offset+gpus-1
//! ```
//!
//! so engines of different tensor-parallel sizes (prefill TP 1 beside decode TP 2) need nothing
//! special.
//!
//! **Pipeline parallelism.** With `p > 1` stages every engine has `tp * p` GPUs, and a stage only
//! holds its own layers, so there is one group per stage: group `s` (named
//! `<group_name>-pp<s>`) holds the trainer (rank 0) and, from every engine in order, the `tp`
//! GPUs of its stage `s`. Each group therefore has `world_size = 1 + sum_i gpus(i) / p` and
//! engine `i` sits at `rank_offset(i) = 1 + sum_{j<i} gpus(j) / p` in every group. All engines
//! must use the same `p` (so stage `s` means the same layers everywhere); the layers of stage `s`
//! are given by [`stage_layer_range`], the split SGLang uses. With `p = 1` there is a single group
//! named `<group_name>`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Bad input to the plan: each variant says which engine and how to fix it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// A weight sync needs at least one receiver.
    #[error("no inference engines to update: start at least one engine before syncing weights")]
    NoEngines,
    /// An engine without GPUs cannot receive anything.
    #[error("engine `{engine}` reports 0 GPUs; every engine needs at least one")]
    ZeroGpus {
        /// The engine.
        engine: String,
    },
    /// The same engine listed twice would get two rank ranges.
    #[error("engine `{engine}` is listed twice; list every engine once")]
    DuplicateEngine {
        /// The engine.
        engine: String,
    },
    /// Zero pipeline stages is meaningless.
    #[error(
        "pipeline stages must be at least 1 (use 1 when inference does not use pipeline parallelism)"
    )]
    ZeroStages,
    /// With `p` stages every engine's GPU count must be `tp * p`.
    #[error(
        "engine `{engine}` has {gpus} GPUs, not a multiple of the {stages} pipeline stages; every \
         engine must run tp x {stages} GPUs with the same pipeline size"
    )]
    StagesDoNotDivide {
        /// The engine.
        engine: String,
        /// Its GPU count.
        gpus: u32,
        /// The configured stages.
        stages: u32,
    },
    /// More ranks than a `u32` world size can count.
    #[error("the engines add up to more than {max} ranks")]
    TooManyRanks {
        /// The limit.
        max: u32,
    },
    /// Group names are sent to every engine and must identify the group.
    #[error("the weight-update group name is empty; give it a name such as `troupe-weights`")]
    EmptyGroupName,
}

/// One inference engine as the weight sync sees it: an id and how many GPUs receive weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineGpus {
    /// Stable engine id (e.g. the server address or actor name), used in errors and the plan.
    pub engine: String,
    /// GPUs of this engine (`tp * pp`).
    pub gpus: u32,
}

/// An engine's place in one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    /// The engine id.
    pub engine: String,
    /// First rank of this engine in the group (sent as `rank_offset` to `/init_weights_update_group`).
    pub rank_offset: u32,
    /// How many consecutive ranks it occupies (its GPUs in this stage).
    pub ranks: u32,
}

/// One weight-update group: the trainer at rank 0 plus the receiving GPUs of one pipeline stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageGroup {
    /// Pipeline stage served by this group (0 without pipeline parallelism).
    pub stage: u32,
    /// Group name, `<name>` or `<name>-pp<stage>`.
    pub group_name: String,
    /// `1 + sum of members' ranks`.
    pub world_size: u32,
    /// Engines in list order, with their rank ranges.
    pub members: Vec<GroupMember>,
}

/// The whole rank layout of a weight sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSyncPlan {
    /// Pipeline stages of the inference engines (1 without pipeline parallelism).
    pub pipeline_stages: u32,
    /// One group per stage, in stage order.
    pub groups: Vec<StageGroup>,
}

impl WeightSyncPlan {
    /// Plans the group(s) for `engines` (in this order) with `pipeline_stages` stages.
    pub fn new(
        group_name: &str,
        engines: &[EngineGpus],
        pipeline_stages: u32,
    ) -> Result<Self, PlanError> {
        if group_name.is_empty() {
            return Err(PlanError::EmptyGroupName);
        }
        if pipeline_stages == 0 {
            return Err(PlanError::ZeroStages);
        }
        if engines.is_empty() {
            return Err(PlanError::NoEngines);
        }
        let mut per_stage = Vec::with_capacity(engines.len());
        for (i, e) in engines.iter().enumerate() {
            if e.gpus == 0 {
                return Err(PlanError::ZeroGpus {
                    engine: e.engine.clone(),
                });
            }
            if engines[..i].iter().any(|other| other.engine == e.engine) {
                return Err(PlanError::DuplicateEngine {
                    engine: e.engine.clone(),
                });
            }
            if e.gpus % pipeline_stages != 0 {
                return Err(PlanError::StagesDoNotDivide {
                    engine: e.engine.clone(),
                    gpus: e.gpus,
                    stages: pipeline_stages,
                });
            }
            per_stage.push(e.gpus / pipeline_stages);
        }
        let offsets = cumulative_offsets(&per_stage)?;
        let world_size = offsets[engines.len()];
        let members: Vec<GroupMember> = engines
            .iter()
            .zip(&offsets)
            .zip(&per_stage)
            .map(|((e, &rank_offset), &ranks)| GroupMember {
                engine: e.engine.clone(),
                rank_offset,
                ranks,
            })
            .collect();
        let groups = (0..pipeline_stages)
            .map(|stage| StageGroup {
                stage,
                group_name: if pipeline_stages == 1 {
                    group_name.to_string()
                } else {
                    format!("{group_name}-pp{stage}")
                },
                world_size,
                members: members.clone(),
            })
            .collect();
        Ok(WeightSyncPlan {
            pipeline_stages,
            groups,
        })
    }

    /// World size of every group (they are all the same size).
    pub fn world_size(&self) -> u32 {
        self.groups.first().map_or(1, |g| g.world_size)
    }

    /// Rank offset of the engine at `index` (the same in every group), if it exists.
    pub fn rank_offset(&self, index: usize) -> Option<u32> {
        self.groups
            .first()
            .and_then(|g| g.members.get(index))
            .map(|m| m.rank_offset)
    }

    /// Rank offset of the engine named `engine`, if it is in the plan.
    pub fn rank_offset_of(&self, engine: &str) -> Option<u32> {
        self.groups
            .first()
            .and_then(|g| g.members.iter().find(|m| m.engine == engine))
            .map(|m| m.rank_offset)
    }
}

/// `world_size = 1 + sum(gpus)` for a flat (single-stage) group.
pub fn world_size(gpus: &[u32]) -> Result<u32, PlanError> {
    Ok(cumulative_offsets(gpus)?[gpus.len()])
}

/// `rank_offset(i) = 1 + sum_{j<i} gpus(j)` for a flat group; `None` if `i` is out of range.
pub fn rank_offset(gpus: &[u32], i: usize) -> Result<Option<u32>, PlanError> {
    if i >= gpus.len() {
        return Ok(None);
    }
    Ok(Some(cumulative_offsets(&gpus[..i])?[i]))
}

/// `[1, 1 + g0, 1 + g0 + g1, ...]`: every engine's offset, then the world size.
fn cumulative_offsets(gpus: &[u32]) -> Result<Vec<u32>, PlanError> {
    let mut offsets = Vec::with_capacity(gpus.len() + 1);
    let mut next = 1u32;
    offsets.push(next);
    for &g in gpus {
        next = next
            .checked_add(g)
            .ok_or(PlanError::TooManyRanks { max: u32::MAX })?;
        offsets.push(next);
    }
    Ok(offsets)
}

/// Decoder layers held by pipeline stage `stage` of `stages`, as SGLang splits them
/// (`get_pp_indices`): `num_layers / stages` each, the remainder going one apiece to the stages
/// before the last (which also carries the final norm and `lm_head`). Empty if `stage` is out of
/// range or `stages` is 0.
pub fn stage_layer_range(num_layers: usize, stages: usize, stage: usize) -> Range<usize> {
    if stages == 0 || stage >= stages {
        return 0..0;
    }
    let base = num_layers / stages;
    let extra = num_layers % stages;
    // Stages `stages - 1 - extra .. stages - 1` (i.e. just before the last) get one more layer.
    let size = |s: usize| base + usize::from(s + 1 < stages && s + 1 + extra >= stages);
    let start: usize = (0..stage).map(size).sum();
    start..start + size(stage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engines(gpus: &[u32]) -> Vec<EngineGpus> {
        gpus.iter()
            .enumerate()
            .map(|(i, &g)| EngineGpus {
                engine: format!("e{i}"),
                gpus: g,
            })
            .collect()
    }

    #[test]
    fn mixed_tp_offsets_are_cumulative() {
        // 2 prefill servers with TP 1, then 2 decode servers with TP 2.
        let plan = WeightSyncPlan::new("w", &engines(&[1, 1, 2, 2]), 1).expect("valid");
        assert_eq!(plan.world_size(), 7);
        let offsets: Vec<u32> = (0..4).filter_map(|i| plan.rank_offset(i)).collect();
        assert_eq!(offsets, vec![1, 2, 3, 5]);
        assert_eq!(plan.rank_offset(4), None);
        assert_eq!(plan.rank_offset_of("e3"), Some(5));
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(plan.groups[0].group_name, "w");
        assert_eq!(world_size(&[1, 1, 2, 2]), Ok(7));
        assert_eq!(rank_offset(&[1, 1, 2, 2], 3), Ok(Some(5)));
        assert_eq!(rank_offset(&[1, 1, 2, 2], 4), Ok(None));
    }

    #[test]
    fn rank_ranges_tile_one_to_world_size_exactly() {
        let gpus = [3, 1, 8, 2, 4];
        let plan = WeightSyncPlan::new("w", &engines(&gpus), 1).expect("valid");
        let mut next = 1;
        for m in &plan.groups[0].members {
            assert_eq!(m.rank_offset, next);
            next += m.ranks;
        }
        assert_eq!(next, plan.world_size());
    }

    #[test]
    fn pipeline_stages_get_one_group_each() {
        // Engines with tp 2 x pp 2 and tp 1 x pp 2.
        let plan = WeightSyncPlan::new("w", &engines(&[4, 2, 4]), 2).expect("valid");
        assert_eq!(plan.groups.len(), 2);
        for (s, g) in plan.groups.iter().enumerate() {
            assert_eq!(g.stage as usize, s);
            assert_eq!(g.group_name, format!("w-pp{s}"));
            assert_eq!(g.world_size, 1 + 2 + 1 + 2);
            let offsets: Vec<u32> = g.members.iter().map(|m| m.rank_offset).collect();
            assert_eq!(offsets, vec![1, 3, 4]);
        }
    }

    #[test]
    fn bad_engine_lists_are_explained() {
        assert_eq!(WeightSyncPlan::new("w", &[], 1), Err(PlanError::NoEngines));
        let err = WeightSyncPlan::new("w", &engines(&[1, 0]), 1).unwrap_err();
        assert!(err.to_string().contains("`e1`"), "{err}");
        let err = WeightSyncPlan::new("w", &engines(&[4, 3]), 2).unwrap_err();
        assert!(matches!(
            err,
            PlanError::StagesDoNotDivide {
                gpus: 3,
                stages: 2,
                ..
            }
        ));
        assert_eq!(
            WeightSyncPlan::new("w", &engines(&[1]), 0),
            Err(PlanError::ZeroStages)
        );
        assert_eq!(
            WeightSyncPlan::new("", &engines(&[1]), 1),
            Err(PlanError::EmptyGroupName)
        );
        let mut dup = engines(&[1, 1]);
        dup[1].engine = "e0".into();
        assert!(matches!(
            WeightSyncPlan::new("w", &dup, 1),
            Err(PlanError::DuplicateEngine { .. })
        ));
        assert!(matches!(
            world_size(&[u32::MAX, 1]),
            Err(PlanError::TooManyRanks { .. })
        ));
    }

    #[test]
    fn stage_layers_follow_sglang_split() {
        let split =
            |n, p| -> Vec<Range<usize>> { (0..p).map(|s| stage_layer_range(n, p, s)).collect() };
        assert_eq!(split(10, 4), vec![0..2, 2..5, 5..8, 8..10]);
        assert_eq!(split(8, 2), vec![0..4, 4..8]);
        assert_eq!(split(7, 1), vec![0..7]);
        assert_eq!(split(3, 3), vec![0..1, 1..2, 2..3]);
        for n in 0..40 {
            for p in 1..6 {
                let ranges = split(n, p);
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[p - 1].end, n);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(stage_layer_range(10, 4, 4), 0..0);
        assert_eq!(stage_layer_range(10, 0, 0), 0..0);
    }
}
