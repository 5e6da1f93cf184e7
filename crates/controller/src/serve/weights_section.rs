//! `weights.*`: how weight syncs travel to the engines.

use serde::Deserialize;
use troupe_weights::delta::DeltaMode;

/// `weights.*` in a deployment's YAML.
#[derive(Debug, Clone, Deserialize)]
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
    /// The most MiB of tensors one bucket of a sync carries (default 1024, at most 16384):
    /// smaller buckets bound the memory a sync stages per step and let a sync of a small model
    /// travel in several buckets.
    #[serde(default = "default_bucket_mib", deserialize_with = "bucket_mib")]
    pub bucket_mib: u64,
    /// `auto` (default): engines that can (the reference engine) stage each update beside
    /// their live weights and swap it in only once every engine has all of it, so a failed
    /// update is dropped whole; while an update is in flight each such engine holds one more
    /// copy of the tensors sent (for a full update, of the model). `off`: every engine applies
    /// buckets as they arrive, and one a failed update reached is held out until a complete
    /// update reaches it (what SGLang and vLLM engines always get).
    #[serde(default)]
    pub staging: troupe_serving::control_plane::Staging,
    /// `all` (default): an update pauses every server, and they resume together on the new
    /// version. `rolling`: a part of each role at a time (`rolling_part`) is taken out of
    /// routing, updated and routed again while the rest serves, so clients see no fleet-wide
    /// stall; prefill/decode pairs stay on one version.
    #[serde(default)]
    pub rollout: RolloutMode,
    /// With `rollout: rolling`, how much of each role one step takes: a share in (0, 1)
    /// (default 0.25, rounded up) or a whole count of servers (1, 2, ...).
    #[serde(default = "default_rolling_part", deserialize_with = "rolling_part")]
    pub rolling_part: f64,
    /// With `rollout: rolling`, how long (seconds) a part taken out of routing may take to
    /// finish the requests already on it before it is paused all the same (default 60).
    #[serde(
        default = "default_rolling_drain_s",
        deserialize_with = "rolling_drain_s"
    )]
    pub rolling_drain_s: f64,
}

/// `weights.rollout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutMode {
    /// Every server at once.
    #[default]
    All,
    /// A part at a time.
    Rolling,
}

impl Default for WeightsSection {
    fn default() -> Self {
        Self {
            delta: DeltaMode::default(),
            bucket_mib: default_bucket_mib(),
            staging: Default::default(),
            rollout: RolloutMode::All,
            rolling_part: default_rolling_part(),
            rolling_drain_s: default_rolling_drain_s(),
        }
    }
}

impl WeightsSection {
    /// The weight sync's rollout: all at once, or rolling by `rolling_part`.
    pub fn rollout(&self) -> troupe_serving::control_plane::Rollout {
        use troupe_serving::control_plane::{PartSize, Rollout};
        match self.rollout {
            RolloutMode::All => Rollout::All,
            RolloutMode::Rolling if self.rolling_part < 1.0 => {
                Rollout::Rolling(PartSize::Fraction(self.rolling_part))
            }
            RolloutMode::Rolling => Rollout::Rolling(PartSize::Count(self.rolling_part as usize)),
        }
    }

    /// `bucket_mib` in bytes.
    pub fn bucket_bytes(&self) -> u64 {
        self.bucket_mib << 20
    }
}

/// The largest `weights.bucket_mib`: 16 GiB, beyond any one tensor a trainer syncs.
pub const MAX_BUCKET_MIB: u64 = 16 << 10;

fn default_bucket_mib() -> u64 {
    troupe_weights::bucket::DEFAULT_BUCKET_BYTES >> 20
}

fn bucket_mib<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let n = u64::deserialize(d)?;
    if n == 0 || n > MAX_BUCKET_MIB {
        return Err(serde::de::Error::custom(format!(
            "weights.bucket_mib must be from 1 to {MAX_BUCKET_MIB} (MiB), got {n}"
        )));
    }
    Ok(n)
}

fn default_rolling_part() -> f64 {
    0.25
}

fn default_rolling_drain_s() -> f64 {
    60.0
}

/// The longest drain accepted: a day.
const MAX_DRAIN_S: f64 = 86_400.0;

fn rolling_drain_s<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let x = f64::deserialize(d)?;
    if !(x.is_finite() && (0.0..=MAX_DRAIN_S).contains(&x)) {
        return Err(serde::de::Error::custom(format!(
            "weights.rolling_drain_s must be from 0 to {MAX_DRAIN_S} seconds, got {x}"
        )));
    }
    Ok(x)
}

fn rolling_part<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let x = f64::deserialize(d)?;
    let ok = x.is_finite() && x > 0.0 && (x < 1.0 || (x.fract() == 0.0 && x <= 65_536.0));
    if !ok {
        return Err(serde::de::Error::custom(format!(
            "weights.rolling_part must be a share in (0, 1) or a whole number of servers, got {x}"
        )));
    }
    Ok(x)
}
