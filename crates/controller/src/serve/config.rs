//! The YAML config of `troupe serve` (and later `troupe run`), with dotted overrides.
//!
//! Keys follow AReaL's where one exists (`allocation_mode`, `cluster.n_nodes`,
//! `cluster.n_gpus_per_node`, `sglang.*`, `rollout.*`), so an AReaL user reads it at a glance.
//! Unknown keys are errors that name the key: a typo must not silently fall back to a default.

use std::path::Path;

use serde::Deserialize;
use serde_yaml_ng::Value;

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// YAML syntax or a value of the wrong shape.
    #[error("invalid config {origin}: {message}")]
    Invalid {
        /// File name (or "overrides").
        origin: String,
        /// What is wrong.
        message: String,
    },
    /// A `key.path=value` override is malformed.
    #[error(
        "bad override {0:?}: write it as dotted.key=value, e.g. rollout.max_concurrent_rollouts=64"
    )]
    Override(String),
}

/// Where actor hosts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerType {
    /// Hosts inside the controller process (laptops, CI).
    #[default]
    Inprocess,
    /// `troupe host` child processes on this machine.
    Local,
    /// One Slurm job: a `troupe host` per node, each with `cluster.n_gpus_per_node` GPUs.
    Slurm,
}

impl SchedulerType {
    fn as_str(self) -> &'static str {
        match self {
            SchedulerType::Inprocess => "inprocess",
            SchedulerType::Local => "local",
            SchedulerType::Slurm => "slurm",
        }
    }
}

/// A list of words given either as a YAML list or as one whitespace-separated string
/// (`container_prefix: apptainer exec --nv img.sif`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Words {
    /// `[a, b, c]`.
    List(Vec<String>),
    /// `"a b c"`.
    Line(String),
}

impl Default for Words {
    fn default() -> Self {
        Words::List(Vec::new())
    }
}

impl Words {
    /// The words.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Words::List(v) => v.clone(),
            Words::Line(s) => s.split_whitespace().map(str::to_string).collect(),
        }
    }
}

/// `scheduler.*`: where hosts come from and, for Slurm, how the job is submitted.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// `inprocess`, `local` or `slurm`.
    #[serde(rename = "type", default)]
    pub kind: SchedulerType,
    /// Slurm partition (`sbatch --partition`); default: the cluster's default partition.
    #[serde(default, deserialize_with = "text")]
    pub partition: Option<String>,
    /// Slurm account (`sbatch --account`).
    #[serde(default, deserialize_with = "text")]
    pub account: Option<String>,
    /// Slurm time limit (`sbatch --time`), e.g. `2:00:00` (a bare number is minutes).
    #[serde(default, deserialize_with = "text")]
    pub time: Option<String>,
    /// More sbatch arguments, verbatim (srun arguments when already inside an allocation).
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Words before the troupe binary on each node, e.g. `apptainer exec --nv troupe.sif`.
    #[serde(default)]
    pub container_prefix: Words,
    /// Seconds the whole job may take to start and have every host report (queueing included).
    #[serde(default = "startup_timeout")]
    pub startup_timeout_s: f64,
    /// IP the hosts report to: `auto` (the interface of the default route) or an address.
    #[serde(default = "auto")]
    pub report_address: String,
    /// Directory for the batch script and job output (shared with the nodes).
    #[serde(default = "log_dir")]
    pub log_dir: String,
    /// The troupe binary as the nodes see it (default: this one).
    #[serde(default)]
    pub binary: Option<String>,
    /// Inside an allocation (`SLURM_JOB_ID` set), start hosts with `srun` in it instead of
    /// submitting a new job.
    #[serde(default = "yes")]
    pub use_allocation: bool,
}

/// A string that YAML (or a `key=value` override) may have read as a number: `time: 30`.
fn text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            return Err(serde::de::Error::custom(format!(
                "expected a string, got {other:?}"
            )));
        }
    })
}

fn startup_timeout() -> f64 {
    300.0
}
fn auto() -> String {
    "auto".into()
}
fn log_dir() -> String {
    "troupe-slurm-logs".into()
}
fn yes() -> bool {
    true
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            kind: SchedulerType::default(),
            partition: None,
            account: None,
            time: None,
            extra_args: Vec::new(),
            container_prefix: Words::default(),
            startup_timeout_s: startup_timeout(),
            report_address: auto(),
            log_dir: log_dir(),
            binary: None,
            use_allocation: true,
        }
    }
}

impl SchedulerConfig {
    /// Rejects Slurm keys under another scheduler type and malformed Slurm values.
    fn check(&self) -> Result<(), String> {
        let slurm_only = [
            ("partition", self.partition.is_some()),
            ("account", self.account.is_some()),
            ("time", self.time.is_some()),
            ("extra_args", !self.extra_args.is_empty()),
            (
                "container_prefix",
                !self.container_prefix.to_vec().is_empty(),
            ),
        ];
        if self.kind != SchedulerType::Slurm {
            if let Some((k, _)) = slurm_only.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "scheduler.{k} applies only to scheduler.type: slurm (this config has type: {}); remove it or set scheduler.type=slurm",
                    self.kind.as_str()
                ));
            }
            return Ok(());
        }
        for (k, v) in [("partition", &self.partition), ("account", &self.account)] {
            if let Some(v) = v
                && (v.is_empty() || v.chars().any(char::is_whitespace))
            {
                return Err(format!(
                    "scheduler.{k} must be one Slurm {k} name without spaces, got {v:?}"
                ));
            }
        }
        if let Some(t) = &self.time {
            let ok = t.eq_ignore_ascii_case("unlimited")
                || (!t.is_empty()
                    && t.chars()
                        .all(|c| c.is_ascii_digit() || c == ':' || c == '-'));
            if !ok {
                return Err(format!(
                    "scheduler.time must be a Slurm time limit such as 30 (minutes), 2:00:00 or 1-00:00:00, got {t:?}"
                ));
            }
        }
        if !(self.startup_timeout_s.is_finite() && self.startup_timeout_s >= 1.0) {
            return Err(format!(
                "scheduler.startup_timeout_s must be at least 1 (seconds to queue and start every host), got {}",
                self.startup_timeout_s
            ));
        }
        if self.report_address != "auto" && self.report_address.parse::<std::net::IpAddr>().is_err()
        {
            return Err(format!(
                "scheduler.report_address must be `auto` or an IP address of this machine that the nodes can reach, got {:?}",
                self.report_address
            ));
        }
        if self.log_dir.trim().is_empty() {
            return Err("scheduler.log_dir must not be empty".into());
        }
        Ok(())
    }
}

/// `cluster.*` (AReaL names).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Number of actor hosts (nodes).
    #[serde(default = "one")]
    pub n_nodes: usize,
    /// GPUs each host offers (CPU-only reference engines still count "GPU" slots for placement).
    #[serde(default = "eight")]
    pub n_gpus_per_node: u32,
}

fn one() -> usize {
    1
}
fn eight() -> u32 {
    8
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            n_nodes: 1,
            n_gpus_per_node: 8,
        }
    }
}

/// `sglang.*`: how inference servers are launched (applies to the troupe engine too).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SglangConfig {
    /// Model path; for the troupe backend also `tiny` or `small`.
    #[serde(default = "tiny")]
    pub model_path: String,
    /// Python interpreter for sglang / vllm.
    #[serde(default = "python")]
    pub python: String,
    /// Empty (default) or `fp8`.
    #[serde(default)]
    pub quantization: String,
    /// PD KV transfer backend (`mooncake`, `nixl`; `tcp` for troupe). Default: `tcp` for the
    /// troupe backend, SGLang's default otherwise.
    #[serde(default)]
    pub disaggregation_transfer_backend: Option<String>,
    /// Extra server flags appended verbatim.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Seconds a server may take to become ready.
    #[serde(default = "ready_timeout")]
    pub ready_timeout_s: f64,
}

fn tiny() -> String {
    "tiny".into()
}
fn python() -> String {
    "python3".into()
}
fn ready_timeout() -> f64 {
    600.0
}

impl Default for SglangConfig {
    fn default() -> Self {
        SglangConfig {
            model_path: tiny(),
            python: python(),
            quantization: String::new(),
            disaggregation_transfer_backend: None,
            extra_args: Vec::new(),
            ready_timeout_s: ready_timeout(),
        }
    }
}

/// `gateway.*`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the gateway listens on.
    #[serde(default = "listen")]
    pub listen: String,
    /// Policy for regular workers, and the default for prefill / decode.
    #[serde(default = "round_robin")]
    pub policy: String,
    /// Policy for prefill workers (default: `policy`).
    #[serde(default)]
    pub prefill_policy: Option<String>,
    /// Policy for decode workers (default: `policy`).
    #[serde(default)]
    pub decode_policy: Option<String>,
    /// Retries of a failed request on another worker.
    #[serde(default = "retries")]
    pub max_retries: u32,
}

fn listen() -> String {
    "127.0.0.1:0".into()
}
fn round_robin() -> String {
    "round_robin".into()
}
fn retries() -> u32 {
    3
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: listen(),
            policy: round_robin(),
            prefill_policy: None,
            decode_policy: None,
            max_retries: retries(),
        }
    }
}

/// `rollout.*` (AReaL names; used by `troupe run`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Most rollouts in flight at once.
    #[serde(default = "max_concurrent")]
    pub max_concurrent_rollouts: usize,
    /// Most versions a trajectory may lag the trainer (0 = synchronous RL).
    #[serde(default = "staleness")]
    pub max_head_offpolicyness: u64,
}

fn max_concurrent() -> usize {
    128
}
fn staleness() -> u64 {
    1
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            max_concurrent_rollouts: max_concurrent(),
            max_head_offpolicyness: staleness(),
        }
    }
}

/// `train.*`: the built-in GRPO trainer and task of `troupe run`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Training steps (each: one batch, one update, one weight sync).
    #[serde(default = "steps")]
    pub steps: usize,
    /// Prompts per batch (trajectories; the staleness budget's unit).
    #[serde(default = "batch")]
    pub batch_size: usize,
    /// Samples per prompt (GRPO group size).
    #[serde(default = "group")]
    pub group_size: usize,
    /// Tokens generated per sample.
    #[serde(default = "max_new")]
    pub max_new_tokens: usize,
    /// Sampling temperature of rollouts (the trainer uses the same).
    #[serde(default = "temperature")]
    pub temperature: f32,
    /// Adam learning rate.
    #[serde(default = "lr")]
    pub lr: f32,
    /// Seed of prompts and samples.
    #[serde(default)]
    pub seed: u64,
    /// The task's target: reward is the fraction of generated bytes equal to it.
    #[serde(default = "target")]
    pub target: String,
}

fn steps() -> usize {
    30
}
fn batch() -> usize {
    8
}
fn group() -> usize {
    4
}
fn max_new() -> usize {
    16
}
fn temperature() -> f32 {
    1.0
}
fn lr() -> f32 {
    1e-2
}
fn target() -> String {
    "a".into()
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: steps(),
            batch_size: batch(),
            group_size: group(),
            max_new_tokens: max_new(),
            temperature: temperature(),
            lr: lr(),
            seed: 0,
            target: target(),
        }
    }
}

/// The whole config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// The allocation mode, e.g. `troupe:(prefill:d2t1|decode:d2t1)`.
    pub allocation_mode: String,
    /// Hosts.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Where hosts come from.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Server launch settings.
    #[serde(default)]
    pub sglang: SglangConfig,
    /// Gateway settings.
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// Rollout settings.
    #[serde(default)]
    pub rollout: RolloutConfig,
    /// Trainer and task settings (`troupe run`).
    #[serde(default)]
    pub train: TrainConfig,
    /// Admin key for control endpoints of servers, router and gateway (default: a fresh random
    /// key, so control endpoints are never open by accident).
    #[serde(default)]
    pub admin_key: Option<String>,
}

/// Sets `a.b.c = value` in a YAML mapping, creating intermediate mappings.
fn set_dotted(root: &mut Value, key: &str, value: Value) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("empty segment in key {key:?}"));
    }
    let mut cur = root;
    for (i, p) in parts.iter().enumerate() {
        let Value::Mapping(m) = cur else {
            return Err(format!("{} is not a mapping", parts[..i].join(".")));
        };
        let k = Value::String((*p).to_string());
        if i + 1 == parts.len() {
            m.insert(k, value);
            return Ok(());
        }
        cur = m
            .entry(k)
            .or_insert_with(|| Value::Mapping(Default::default()));
    }
    Ok(())
}

impl ServeConfig {
    /// Parses YAML text and applies `key.path=value` overrides (values parsed as YAML scalars).
    pub fn from_yaml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            message,
        };
        let mut v: Value = serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if matches!(v, Value::Null) {
            v = Value::Mapping(Default::default());
        }
        for o in overrides {
            let (k, val) = o
                .split_once('=')
                .ok_or_else(|| ConfigError::Override(o.clone()))?;
            // `key=` means the empty string; otherwise the value is read as a YAML scalar.
            let val: Value = match serde_yaml_ng::from_str(val) {
                Ok(Value::Null) | Err(_) => Value::String(val.to_string()),
                Ok(v) => v,
            };
            set_dotted(&mut v, k.trim(), val).map_err(|m| ConfigError::Invalid {
                origin: format!("override {o:?}"),
                message: m,
            })?;
        }
        let cfg: ServeConfig = serde_yaml_ng::from_value(v).map_err(|e| invalid(e.to_string()))?;
        cfg.check().map_err(invalid)?;
        Ok(cfg)
    }

    /// Reads a config file and applies overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string(), overrides)
    }

    fn check(&self) -> Result<(), String> {
        if self.cluster.n_nodes == 0 {
            return Err("cluster.n_nodes must be at least 1".into());
        }
        self.scheduler.check()?;
        if !matches!(self.sglang.quantization.as_str(), "" | "fp8") {
            return Err(format!(
                "sglang.quantization must be empty or \"fp8\", got {:?}",
                self.sglang.quantization
            ));
        }
        if !(self.sglang.ready_timeout_s.is_finite() && self.sglang.ready_timeout_s >= 0.001) {
            return Err("sglang.ready_timeout_s must be positive".into());
        }
        if self.rollout.max_concurrent_rollouts == 0 {
            return Err("rollout.max_concurrent_rollouts must be at least 1".into());
        }
        let t = &self.train;
        if t.steps == 0 || t.batch_size == 0 || t.group_size < 2 || t.max_new_tokens == 0 {
            return Err(
                "train.steps, train.batch_size and train.max_new_tokens must be at least 1, and train.group_size at least 2 (GRPO compares samples within a group)".into(),
            );
        }
        if t.target.len() != 1 {
            return Err(format!(
                "train.target must be exactly one byte (e.g. \"a\"), got {:?}",
                t.target
            ));
        }
        if !(t.lr.is_finite() && t.lr > 0.0 && t.temperature.is_finite() && t.temperature > 0.0) {
            return Err("train.lr and train.temperature must be positive numbers".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_keys_are_checked_and_named() {
        let c = ServeConfig::from_yaml(
            "allocation_mode: x\nscheduler:\n  type: slurm\n  partition: gpu\n  time: '2:00:00'\n  container_prefix: apptainer exec --nv t.sif\n",
            "t.yaml",
            &[],
        )
        .unwrap();
        assert_eq!(c.scheduler.kind, SchedulerType::Slurm);
        assert_eq!(
            c.scheduler.container_prefix.to_vec(),
            ["apptainer", "exec", "--nv", "t.sif"]
        );
        let bad = |o: &str| {
            ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &[o.to_string()])
                .unwrap_err()
                .to_string()
        };
        let c = ServeConfig::from_yaml(
            "allocation_mode: x\n",
            "t.yaml",
            &["scheduler.type=slurm".into(), "scheduler.time=30".into()],
        )
        .unwrap();
        assert_eq!(c.scheduler.time.as_deref(), Some("30"));
        let e = bad("scheduler.partition=gpu");
        assert!(
            e.contains("scheduler.partition") && e.contains("type: slurm"),
            "{e}"
        );
        let e = ServeConfig::from_yaml(
            "allocation_mode: x\nscheduler: {type: slurm, time: 'two hours'}\n",
            "t.yaml",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("scheduler.time") && e.contains("2:00:00"), "{e}");
        let e = bad("scheduler.type=pbs");
        assert!(e.contains("slurm"), "{e}");
        let e = bad("scheduler.partiton=gpu");
        assert!(e.contains("partiton"), "{e}");
        let e = ServeConfig::from_yaml(
            "allocation_mode: x\nscheduler: {type: slurm, report_address: somewhere}\n",
            "t.yaml",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("scheduler.report_address"), "{e}");
    }

    #[test]
    fn overrides_set_nested_keys_with_typed_values() {
        let c = ServeConfig::from_yaml(
            "allocation_mode: 'troupe:d1'\nrollout:\n  max_concurrent_rollouts: 8\n",
            "t.yaml",
            &[
                "rollout.max_concurrent_rollouts=64".into(),
                "sglang.quantization=fp8".into(),
                "cluster.n_nodes=2".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.rollout.max_concurrent_rollouts, 64);
        assert_eq!(c.sglang.quantization, "fp8");
        assert_eq!(c.cluster.n_nodes, 2);
    }

    #[test]
    fn unknown_keys_and_bad_overrides_are_named() {
        let e =
            ServeConfig::from_yaml("allocation_mode: x\nrolout: {}\n", "t.yaml", &[]).unwrap_err();
        assert!(e.to_string().contains("rolout"), "{e}");
        let e = ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &["nokey".into()])
            .unwrap_err();
        assert!(e.to_string().contains("dotted.key=value"), "{e}");
        let e = ServeConfig::from_yaml(
            "allocation_mode: x\n",
            "t.yaml",
            &["sglang.quantization=int4".into()],
        )
        .unwrap_err();
        assert!(e.to_string().contains("fp8"), "{e}");
        let e = ServeConfig::from_yaml(
            "allocation_mode: x\n",
            "t.yaml",
            &["allocation_mode.x=1".into()],
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a mapping"), "{e}");
    }
}
