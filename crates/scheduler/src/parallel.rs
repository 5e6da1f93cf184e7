//! The parallel strategy of one group: data, tensor, pipeline, context and expert sizes.

use serde::{Deserialize, Serialize};

/// Sizes of the parallel dimensions of one group.
///
/// It exists so that every config path (mode string, YAML) lands on the same numbers, and so that
/// GPU arithmetic (`world = d·t·p·c`, `e` adds none) lives in one place. All sizes are at least 1
/// in a validated plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Parallel {
    /// Data parallel size; for inference, the number of server instances.
    pub dp: u32,
    /// Tensor parallel size.
    pub tp: u32,
    /// Pipeline parallel size.
    pub pp: u32,
    /// Context parallel size (training only).
    pub cp: u32,
    /// Expert parallel size (training only; adds no GPUs).
    pub ep: u32,
    /// Expert tensor parallel size (MoE hybrid `ffn:t…`; training only).
    pub etp: u32,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            etp: 1,
        }
    }
}

impl Parallel {
    /// GPUs used: `d·t·p·c` (saturating, so absurd inputs cannot overflow; validation caps it).
    pub fn world_size(&self) -> u64 {
        [self.dp, self.tp, self.pp, self.cp]
            .into_iter()
            .fold(1u64, |acc, x| acc.saturating_mul(u64::from(x)))
    }

    /// GPUs of one model replica of an inference server: `t·p`.
    pub fn model_parallel_size(&self) -> u64 {
        u64::from(self.tp).saturating_mul(u64::from(self.pp))
    }

    /// Expert model parallel size `p·etp·e`, which must divide the world size when `e > 1`.
    pub fn expert_model_parallel_size(&self) -> u64 {
        [self.pp, self.etp, self.ep]
            .into_iter()
            .fold(1u64, |acc, x| acc.saturating_mul(u64::from(x)))
    }

    /// Renders `d` always, then the other dims named in `letters` (subset of `dtpce`, in that
    /// order) that differ from 1, as in `d4t2` or `d1p2`.
    pub(crate) fn dims_string(&self, letters: &str) -> String {
        let mut out = String::new();
        for letter in letters.chars() {
            let value = match letter {
                'd' => self.dp,
                't' => self.tp,
                'p' => self.pp,
                'c' => self.cp,
                'e' => self.ep,
                _ => continue,
            };
            if value != 1 || letter == 'd' {
                out.push(letter);
                out.push_str(&value.to_string());
            }
        }
        out
    }
}
