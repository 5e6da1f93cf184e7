//! `weights.*`: how weight syncs travel to the engines.

use serde::Deserialize;
use troupe_weights::delta::DeltaMode;

/// `weights.*` in a deployment's YAML.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsSection {
    /// `auto` (default): when some engine is on another machine, send only what changed since
    /// the version the engines hold (whole where that does not pay or an engine does not hold
    /// it); engines that all read the trainer machine's shared-memory ring get every byte.
    /// `on`: deltas for the ring too. `off`: every byte every sync, nothing kept. `compress`: as
    /// `on`, and dense blocks XOR + zstd where smaller (links slower than about 1 GB/s). Deltas
    /// keep one more encoded copy of the model on the trainer's process.
    #[serde(default)]
    pub delta: DeltaMode,
}
