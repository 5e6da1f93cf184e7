//! The YAML config of `troupe serve` (and later `troupe run`), with dotted overrides.
//!
//! Keys follow AReaL's where one exists (`allocation_mode`, `cluster.n_nodes`,
//! `cluster.n_gpus_per_node`, `sglang.*`, `rollout.*`), so an AReaL user reads it at a glance.
//! Unknown keys are errors that name the key: a typo must not silently fall back to a default.

use std::path::Path;

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_yaml_ng::Value;
use troupe_wire::engine_args::EngineDialect;

pub use super::gateway_section::GatewaySection;
pub use super::sched::{SchedulerConfig, SchedulerType, Words};
pub use super::vllm_section::{VllmConfig, VllmDevice};
// The duration rule lives in `seconds.rs` (`sched.rs` checks with it too); re-exported so
// `serve::config::MAX_SECONDS` keeps working.
pub use super::rollout_section::RolloutConfig;
pub use super::seconds::MAX_SECONDS;
use super::seconds::check_seconds;

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

/// `sglang.*`: how inference servers are launched (applies to the troupe engine too). Besides
/// Troupe's own keys, every field of SGLang's `ServerArgs` by its Python name (AReaL's
/// `SGLangConfig` keys are a subset), checked at load against the pinned SGLang's list.
#[derive(Debug, Clone, Deserialize)]
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
    /// Every other key: a field of SGLang's `ServerArgs` (`mem_fraction_static: 0.8` becomes
    /// `--mem-fraction-static 0.8`; see `troupe_wire::engine_args`).
    #[serde(flatten)]
    pub args: BTreeMap<String, serde_json::Value>,
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
            args: BTreeMap::new(),
        }
    }
}

/// `train.*`: the built-in GRPO trainer and task of `troupe run`.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
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

/// Most training steps (`train.steps`).
pub const MAX_STEPS: usize = 1 << 24;
/// Largest GRPO group (`train.group_size`).
pub const MAX_GROUP_SIZE: usize = 1 << 10;
/// Most tokens generated per sample (`train.max_new_tokens`).
pub const MAX_NEW_TOKENS: usize = 1 << 17;
/// Most tokens one step's batch may hold (batch × group × max_new_tokens): each is kept with
/// its log-probability and version until the step's update, about 16 bytes, so 1 GiB.
pub const MAX_STEP_TOKENS: u64 = 1 << 26;

impl TrainConfig {
    /// Every size at least its minimum and at most what it may allocate.
    fn check_sizes(&self) -> Result<(), String> {
        for (key, v, least, most) in [
            ("train.steps", self.steps, 1, MAX_STEPS),
            ("train.group_size", self.group_size, 2, MAX_GROUP_SIZE),
            (
                "train.max_new_tokens",
                self.max_new_tokens,
                1,
                MAX_NEW_TOKENS,
            ),
        ] {
            if !(least..=most).contains(&v) {
                let why = if key == "train.group_size" {
                    " (GRPO compares samples within a group)"
                } else {
                    ""
                };
                return Err(format!("{key} must be {least} to {most}{why}, got {v}"));
            }
        }
        let tokens = (self.batch_size as u64)
            .saturating_mul(self.group_size as u64)
            .saturating_mul(self.max_new_tokens as u64);
        if tokens > MAX_STEP_TOKENS {
            return Err(format!(
                "train.batch_size x train.group_size x train.max_new_tokens = {tokens} tokens per step, more than {MAX_STEP_TOKENS}; make the batch, the groups or the generations smaller"
            ));
        }
        Ok(())
    }
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

/// `python.*`: how hosts run Python actors' worker processes.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PythonConfig {
    /// The interpreter every host starts workers with (it must have the `troupe` package);
    /// default: the controller's own (`sys.executable`).
    #[serde(default)]
    pub executable: Option<String>,
}

/// The whole config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// The allocation mode, e.g. `troupe:(prefill:d2t1|decode:d2t1)`.
    pub allocation_mode: String,
    /// The config as loaded (its YAML after overrides, as JSON): what `troupe serve` records
    /// in its state file, so `--recover` can tell a different config (`super::recover`).
    #[serde(skip)]
    pub source: serde_json::Value,
    /// The installed vLLM's argument list when it is another version than the pin (read at
    /// load: `installed_args.rs`); `vllm.*` keys are checked against it.
    #[serde(skip)]
    pub vllm_args: Option<troupe_wire::engine_args::ArgTable>,
    /// Hosts.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Where hosts come from.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Server launch settings.
    #[serde(default)]
    pub sglang: SglangConfig,
    /// vLLM servers: Troupe's own keys (`python`, `device`) and vLLM's arguments by their
    /// Python names (`gpu_memory_utilization: 0.9`), for `vllm:` components.
    #[serde(default)]
    pub vllm: VllmConfig,
    /// Gateway settings.
    #[serde(default)]
    pub gateway: GatewaySection,
    /// Weight sync settings (`weights.delta`).
    #[serde(default)]
    pub weights: super::weights_section::WeightsSection,
    /// Rollout settings.
    #[serde(default)]
    pub rollout: RolloutConfig,
    /// The autoscaler (`autoscale.*`; off unless `enabled: true`).
    #[serde(default)]
    pub autoscale: super::autoscale_section::AutoscaleSection,
    /// Trainer and task settings (`troupe run`).
    #[serde(default)]
    pub train: TrainConfig,
    /// Python actors (`cluster.host(i).spawn(...)` from the Python API).
    #[serde(default)]
    pub python: PythonConfig,
    /// Admin key for control endpoints of servers, router and gateway (default: a fresh random
    /// key, so control endpoints are never open by accident).
    #[serde(default)]
    pub admin_key: Option<String>,
    /// Control-plane token of the hosts' gRPC and the controller API (default:
    /// `$TROUPE_TOKEN`). Required to serve the API on a non-loopback address.
    #[serde(default)]
    pub token: Option<String>,
    /// TLS for gRPC: `{cert, key, ca}` PEM files (default: `$TROUPE_TLS_CERT`,
    /// `$TROUPE_TLS_KEY`, `$TROUPE_TLS_CA`). Hosts and the API serve with cert / key; the
    /// controller verifies hosts against ca.
    #[serde(default)]
    pub tls: Option<troupe_actors::tls::TlsFiles>,
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
    /// The flags the `sglang:` (or `vllm:`) engine fields become, in field-name order; an
    /// error names an unknown field (with the closest valid names) or one Troupe sets itself.
    pub fn engine_flags(&self, family: EngineDialect) -> Result<Vec<String>, String> {
        match family {
            EngineDialect::Sglang => family.to_flags(&self.sglang.args),
            EngineDialect::Vllm => family.to_flags_in(self.vllm_args.as_ref(), &self.vllm.args),
        }
    }

    /// The environment the `vllm:` engine fields add to vLLM servers (secrets that must not be
    /// flags, such as `hf_token`).
    pub fn engine_env(&self, family: EngineDialect) -> BTreeMap<String, String> {
        match family {
            EngineDialect::Sglang => family.to_env(&self.sglang.args),
            EngineDialect::Vllm => family.to_env(&self.vllm.args),
        }
    }

    /// Parses YAML text and applies `key.path=value` overrides (values parsed as YAML scalars).
    pub fn from_yaml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            message,
        };
        troupe_scheduler::yaml::check(text).map_err(invalid)?;
        let mut v: Value = serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if matches!(v, Value::Null) {
            v = Value::Mapping(Default::default());
        }
        for o in overrides {
            let (k, val) = o
                .split_once('=')
                .ok_or_else(|| ConfigError::Override(o.clone()))?;
            // `key=` means the empty string; otherwise the value is read as a YAML scalar.
            troupe_scheduler::yaml::check(val).map_err(|m| ConfigError::Invalid {
                origin: format!("override {o:?}"),
                message: m,
            })?;
            let val: Value = match serde_yaml_ng::from_str(val) {
                Ok(Value::Null) | Err(_) => Value::String(val.to_string()),
                Ok(v) => v,
            };
            set_dotted(&mut v, k.trim(), val).map_err(|m| ConfigError::Invalid {
                origin: format!("override {o:?}"),
                message: m,
            })?;
        }
        let source = serde_json::to_value(&v).unwrap_or_default();
        // The error names the key (e.g. `gateway.policy: unknown variant ...`).
        let mut cfg: ServeConfig = serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            invalid(if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            })
        })?;
        if cfg.uses(troupe_scheduler::Backend::Vllm) {
            let python = cfg.vllm.python.as_ref().unwrap_or(&cfg.sglang.python);
            cfg.vllm_args = super::installed_args::vllm_table(python);
        }
        let reference = cfg.uses(troupe_scheduler::Backend::Troupe);
        let flags: Vec<String> = [EngineDialect::Sglang, EngineDialect::Vllm]
            .into_iter()
            .flat_map(|d| cfg.engine_flags(d).unwrap_or_default())
            .chain(cfg.sglang.extra_args.iter().cloned())
            .collect();
        cfg.gateway
            .resolve_tokenizer(&cfg.sglang.model_path, reference, &flags);
        cfg.check().map_err(invalid)?;
        cfg.source = source;
        Ok(cfg)
    }

    /// Whether a component of the allocation runs `backend` (false for a mode that does not
    /// parse: `check` reports it).
    fn uses(&self, backend: troupe_scheduler::Backend) -> bool {
        troupe_scheduler::AllocationPlan::parse(&self.allocation_mode)
            .is_ok_and(|p| p.components.iter().any(|c| c.backend == backend))
    }

    /// Reads a config file and applies overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let read_err = |source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        };
        // A regular file, read with a bound: a FIFO or /dev/zero given as the config must not
        // hang or grow the controller.
        // stat before open: opening a FIFO would block until a writer comes.
        if !std::fs::metadata(path).map_err(read_err)?.is_file() {
            return Err(read_err(std::io::Error::other(
                "not a regular file; give the path of a YAML file",
            )));
        }
        let file = std::fs::File::open(path).map_err(read_err)?;
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut std::io::Read::take(file, troupe_scheduler::yaml::MAX_BYTES as u64 + 1),
            &mut text,
        )
        .map_err(read_err)?;
        Self::from_yaml(&text, &path.display().to_string(), overrides)
    }

    /// The control-plane token: the config's, else `$TROUPE_TOKEN` (empty means none).
    pub fn token(&self) -> Option<String> {
        self.token
            .clone()
            .or_else(|| std::env::var(troupe_actors::auth::TOKEN_ENV).ok())
            .filter(|t| !t.is_empty())
    }

    /// The TLS files: the config's `tls`, else the environment's.
    pub fn tls(&self) -> troupe_actors::tls::TlsFiles {
        self.tls
            .clone()
            .unwrap_or_else(troupe_actors::tls::TlsFiles::from_env)
    }

    fn check(&self) -> Result<(), String> {
        let (n, g) = (self.cluster.n_nodes, self.cluster.n_gpus_per_node);
        if n == 0 {
            return Err("cluster.n_nodes must be at least 1".into());
        }
        if n > troupe_scheduler::MAX_HOSTS {
            return Err(format!(
                "cluster.n_nodes {n} is more than the supported {}",
                troupe_scheduler::MAX_HOSTS
            ));
        }
        let gpus = (n as u64).saturating_mul(u64::from(g));
        if gpus > troupe_scheduler::MAX_GPUS {
            return Err(format!(
                "cluster.n_nodes {n} x cluster.n_gpus_per_node {g} = {gpus} GPUs, more than the supported {}",
                troupe_scheduler::MAX_GPUS
            ));
        }
        self.scheduler.check()?;
        self.gateway.check()?;
        self.check_gateway_port()?;
        if !matches!(self.sglang.quantization.as_str(), "" | "fp8") {
            return Err(format!(
                "sglang.quantization must be empty or \"fp8\", got {:?}",
                self.sglang.quantization
            ));
        }
        check_seconds("sglang.ready_timeout_s", self.sglang.ready_timeout_s, 0.001)?;
        self.engine_flags(EngineDialect::Sglang)?;
        self.engine_flags(EngineDialect::Vllm)?;
        troupe_wire::engine_args::check_extra_args(&self.sglang.extra_args)
            .map_err(|e| format!("sglang.{e}"))?;
        self.check_tls()?;
        self.check_model_path()?;
        self.autoscale.options()?;
        let t = &self.train;
        crate::rollout::RolloutOptions {
            max_concurrent: self.rollout.max_concurrent_rollouts,
            max_staleness: self.rollout.max_head_offpolicyness,
            batch_size: t.batch_size,
        }
        .check(|k| {
            match k {
                "batch_size" => "train.batch_size",
                "max_concurrent" => "rollout.max_concurrent_rollouts",
                _ => "rollout.max_head_offpolicyness",
            }
            .to_string()
        })?;
        t.check_sizes()?;
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

impl ServeConfig {
    /// `tls.*` applies to hosts reached over gRPC: refused with in-process hosts (it would be
    /// silently unused), and every named file must exist.
    fn check_tls(&self) -> Result<(), String> {
        let Some(t) = &self.tls else {
            return Ok(());
        };
        if self.scheduler.kind == SchedulerType::Inprocess {
            return Err("tls applies to hosts reached over the network; scheduler.type: inprocess runs hosts inside this process, where it would be ignored: remove tls or use scheduler.type: local or slurm".into());
        }
        for (key, path) in [("cert", &t.cert), ("key", &t.key), ("ca", &t.ca)] {
            if let Some(p) = path
                && !p.is_file()
            {
                return Err(format!("tls.{key}: {} is not a readable file", p.display()));
            }
        }
        Ok(())
    }

    /// A `gateway.listen` with a fixed port on this machine must be free before anything
    /// launches (with Slurm or Ray the gateway may run on another node, so it is not probed here).
    fn check_gateway_port(&self) -> Result<(), String> {
        let Ok(addr) = self.gateway.listen.parse::<std::net::SocketAddr>() else {
            return Ok(());
        };
        if addr.port() == 0 || self.scheduler.kind.remote_hosts() {
            return Ok(());
        }
        match std::net::TcpListener::bind(addr) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(format!(
                "gateway.listen {addr} is already in use by another process; pick a free port, or port 0 for any"
            )),
            _ => Ok(()),
        }
    }

    /// A model path that names a file or directory on this machine must exist before any
    /// server launches. Built-in sizes (`tiny`, `small`) and hub ids (`org/name`) are not paths;
    /// with Slurm or Ray the path is read on the nodes, so it is not checked here.
    fn check_model_path(&self) -> Result<(), String> {
        let p = self.sglang.model_path.as_str();
        let local = p.starts_with('/') || p.starts_with("./") || p.starts_with("../");
        if local && !self.scheduler.kind.remote_hosts() && !Path::new(p).exists() {
            return Err(format!(
                "sglang.model_path {p:?} does not exist on this machine; give an existing checkpoint path (or `tiny` for the reference engine's built-in model)"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
