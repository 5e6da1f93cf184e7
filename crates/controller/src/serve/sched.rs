//! `scheduler.*` of the serve config: where actor hosts come from (in-process, local
//! processes, a Slurm job, a Ray cluster) and how the Slurm job is submitted or the Ray
//! placement group asked for. Kept apart from the rest of the config because the Slurm and Ray
//! keys carry their own checks.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_yaml_ng::Value;

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
    /// A Ray cluster: a placement-group bundle per host, a Ray actor on each running the host.
    Ray,
}

impl SchedulerType {
    /// The config spelling (`inprocess`, `local`, `slurm`).
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulerType::Inprocess => "inprocess",
            SchedulerType::Local => "local",
            SchedulerType::Slurm => "slurm",
            SchedulerType::Ray => "ray",
        }
    }

    /// Whether hosts (and the gateway) may run on other machines, where this machine's files
    /// and ports say nothing: Slurm's nodes, a Ray cluster's.
    pub fn remote_hosts(self) -> bool {
        matches!(self, SchedulerType::Slurm | SchedulerType::Ray)
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
    /// `inprocess`, `local`, `slurm` or `ray`.
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
    /// Seconds the whole job (Slurm) or placement group (Ray) may take to start and have every
    /// host report (queueing included).
    #[serde(default = "startup_timeout")]
    pub startup_timeout_s: f64,
    /// IP the hosts report to: `auto` (the interface of the default route) or an address
    /// (Slurm and Ray).
    #[serde(default = "auto")]
    pub report_address: String,
    /// Directory for the batch script and job output (shared with the nodes).
    #[serde(default = "log_dir")]
    pub log_dir: String,
    /// The troupe binary as the nodes see it (default: this one; Slurm and Ray).
    #[serde(default)]
    pub binary: Option<String>,
    /// Inside an allocation (`SLURM_JOB_ID` set), start hosts with `srun` in it instead of
    /// submitting a new job.
    #[serde(default = "yes")]
    pub use_allocation: bool,
    /// Ray: the cluster's address, `auto` (`RAY_ADDRESS`, else the cluster this machine is part
    /// of) or the GCS address `ip:port`.
    #[serde(default)]
    pub address: Option<String>,
    /// Ray: the namespace of the launcher's job and its host actors.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Ray: how the hosts' bundles spread over nodes (`STRICT_SPREAD`, the default, one host per
    /// node; `SPREAD`; `PACK`; `STRICT_PACK`).
    #[serde(default)]
    pub placement_strategy: Option<String>,
    /// Ray: CPUs each host's bundle reserves (default 1).
    #[serde(default)]
    pub cpus_per_host: Option<f64>,
    /// Ray: more resources each host's bundle reserves (custom resources, by name).
    #[serde(default)]
    pub resources: BTreeMap<String, f64>,
    /// Ray: the runtime environment of the launcher's job, as Ray takes it (`env_vars`, ...).
    #[serde(default)]
    pub runtime_env: Option<serde_json::Value>,
    /// Ray: the Python interpreter (with `ray` installed) that runs the launcher (default
    /// `python3`).
    #[serde(default)]
    pub python: Option<String>,
    /// Ray: wait for an autoscaler instead of failing at once when Ray finds the placement
    /// group infeasible (default false: a fixed cluster never will fit it).
    #[serde(default)]
    pub wait_for_autoscaler: bool,
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
            address: None,
            namespace: None,
            placement_strategy: None,
            cpus_per_host: None,
            resources: BTreeMap::new(),
            runtime_env: None,
            python: None,
            wait_for_autoscaler: false,
        }
    }
}

impl SchedulerConfig {
    /// Rejects Slurm keys under another scheduler type and malformed Slurm values.
    pub(super) fn check(&self) -> Result<(), String> {
        super::seconds::check_seconds("scheduler.startup_timeout_s", self.startup_timeout_s, 1.0)?;
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
        self.check_ray()?;
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

    /// Rejects Ray keys under another scheduler type and malformed Ray values.
    fn check_ray(&self) -> Result<(), String> {
        let ray_only = [
            ("address", self.address.is_some()),
            ("namespace", self.namespace.is_some()),
            ("placement_strategy", self.placement_strategy.is_some()),
            ("cpus_per_host", self.cpus_per_host.is_some()),
            ("resources", !self.resources.is_empty()),
            ("runtime_env", self.runtime_env.is_some()),
            ("python", self.python.is_some()),
            ("wait_for_autoscaler", self.wait_for_autoscaler),
        ];
        if self.kind != SchedulerType::Ray {
            if let Some((k, _)) = ray_only.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "scheduler.{k} applies only to scheduler.type: ray (this config has type: {}); remove it or set scheduler.type=ray",
                    self.kind.as_str()
                ));
            }
            return Ok(());
        }
        if let Some(s) = &self.placement_strategy {
            troupe_scheduler::launch::RayStrategy::parse(s)?;
        }
        if let Some(c) = self.cpus_per_host
            && !(c.is_finite() && (0.0..=4096.0).contains(&c))
        {
            return Err(format!(
                "scheduler.cpus_per_host must be a number of CPUs from 0 to 4096, got {c}"
            ));
        }
        for (k, v) in &self.resources {
            if k.trim().is_empty() || matches!(k.as_str(), "CPU" | "GPU") {
                return Err(format!(
                    "scheduler.resources names Ray custom resources; {k:?} is not one (CPUs come from scheduler.cpus_per_host, GPUs from cluster.n_gpus_per_node)"
                ));
            }
            if !(v.is_finite() && *v > 0.0) {
                return Err(format!(
                    "scheduler.resources.{k} must be a positive amount, got {v}"
                ));
            }
        }
        if let Some(e) = &self.runtime_env
            && !e.is_object()
        {
            return Err(format!(
                "scheduler.runtime_env must be a mapping as Ray takes it (env_vars, pip, working_dir, ...), got {e}"
            ));
        }
        for (k, v) in [("address", &self.address), ("python", &self.python)] {
            if let Some(v) = v
                && v.trim().is_empty()
            {
                return Err(format!("scheduler.{k} must not be empty"));
            }
        }
        if self.report_address != "auto" && self.report_address.parse::<std::net::IpAddr>().is_err()
        {
            return Err(format!(
                "scheduler.report_address must be `auto` or an IP address of this machine that the Ray nodes can reach, got {:?}",
                self.report_address
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::ServeConfig;
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
    fn ray_keys_are_checked_and_named() {
        let c = ServeConfig::from_yaml(
            "allocation_mode: x\nscheduler:\n  type: ray\n  address: 10.0.0.1:6379\n  placement_strategy: pack\n  resources: {troupe_node: 1}\n  runtime_env: {env_vars: {A: b}}\n",
            "t.yaml",
            &[],
        )
        .unwrap();
        assert_eq!(c.scheduler.kind, SchedulerType::Ray);
        assert_eq!(c.scheduler.resources.get("troupe_node"), Some(&1.0));
        let bad = |yaml: &str| {
            ServeConfig::from_yaml(yaml, "t.yaml", &[])
                .unwrap_err()
                .to_string()
        };
        let e = bad("allocation_mode: x\nscheduler: {type: slurm, namespace: rl}\n");
        assert!(
            e.contains("scheduler.namespace") && e.contains("type: ray"),
            "{e}"
        );
        let e = bad("allocation_mode: x\nscheduler: {type: ray, placement_strategy: wide}\n");
        assert!(e.contains("scheduler.placement_strategy"), "{e}");
        let e = bad("allocation_mode: x\nscheduler: {type: ray, resources: {GPU: 1}}\n");
        assert!(e.contains("scheduler.resources"), "{e}");
        let e = bad("allocation_mode: x\nscheduler: {type: ray, runtime_env: conda}\n");
        assert!(e.contains("scheduler.runtime_env"), "{e}");
        let e = bad("allocation_mode: x\nscheduler: {type: ray, partition: gpu}\n");
        assert!(e.contains("type: slurm"), "{e}");
    }

    // The config names no model, so it needs the built-in reference engine.
    #[cfg(feature = "reference")]
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
}
