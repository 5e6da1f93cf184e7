//! The Ray launcher's settings, the launch spec it hands its Python half, and the events that
//! half prints: pure data, unit-tested without Ray.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::LaunchRequest;

/// The launcher's Python half (`python/troupe/ray_launcher.py`), compiled in so the controller
/// needs no installed `troupe` package: it is written to a private directory and run as a
/// script with [`RayOptions::python`].
pub const LAUNCHER_PY: &str = include_str!("../../../../python/troupe/ray_launcher.py");

/// Prefix of an event line on the launcher's stdout.
pub const EVENT_PREFIX: &str = "troupe-ray ";

/// How Ray spreads the hosts' bundles over nodes (Ray's placement-group strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RayStrategy {
    /// Every host on a node of its own (the default: one host per node, as under Slurm).
    #[default]
    StrictSpread,
    /// Spread over nodes where possible.
    Spread,
    /// Pack onto as few nodes as possible.
    Pack,
    /// All hosts on one node.
    StrictPack,
}

impl RayStrategy {
    /// Ray's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RayStrategy::StrictSpread => "STRICT_SPREAD",
            RayStrategy::Spread => "SPREAD",
            RayStrategy::Pack => "PACK",
            RayStrategy::StrictPack => "STRICT_PACK",
        }
    }

    /// Parses Ray's spelling (any case); the error lists the accepted ones.
    pub fn parse(s: &str) -> Result<RayStrategy, String> {
        match s.to_ascii_uppercase().as_str() {
            "STRICT_SPREAD" => Ok(RayStrategy::StrictSpread),
            "SPREAD" => Ok(RayStrategy::Spread),
            "PACK" => Ok(RayStrategy::Pack),
            "STRICT_PACK" => Ok(RayStrategy::StrictPack),
            _ => Err(format!(
                "scheduler.placement_strategy must be STRICT_SPREAD, SPREAD, PACK or STRICT_PACK, got {s:?}"
            )),
        }
    }
}

/// Settings of the Ray launcher (`scheduler.*` of the config with `type: ray`).
#[derive(Debug, Clone)]
pub struct RayOptions {
    /// Interpreter with `ray` installed that runs the launcher's Python half.
    pub python: String,
    /// Cluster address: `auto` (`RAY_ADDRESS`, else the cluster this machine belongs to) or
    /// the GCS address `ip:port`.
    pub address: String,
    /// Ray namespace for the launcher's job (its actors are named in it).
    pub namespace: Option<String>,
    /// Placement strategy of the hosts' bundles.
    pub strategy: RayStrategy,
    /// CPUs each host's bundle reserves.
    pub cpus_per_host: f64,
    /// More resources each bundle reserves (Ray custom resources, e.g. `{"accelerator_type:H100": 0.001}`).
    pub resources: BTreeMap<String, f64>,
    /// Ray runtime environment of the launcher's job (env_vars, pip, ...), as Ray takes it.
    pub runtime_env: Option<serde_json::Value>,
    /// IP the hosts report to; `None` picks the interface of the default route.
    pub report_ip: Option<std::net::IpAddr>,
    /// Fail at once when Ray finds the placement group infeasible (a fixed cluster); off for
    /// an autoscaling cluster, where waiting lets nodes be added.
    pub fail_infeasible: bool,
}

impl Default for RayOptions {
    fn default() -> Self {
        RayOptions {
            python: "python3".into(),
            address: "auto".into(),
            namespace: None,
            strategy: RayStrategy::default(),
            cpus_per_host: 1.0,
            resources: BTreeMap::new(),
            runtime_env: None,
            report_ip: None,
            fail_infeasible: true,
        }
    }
}

/// The names of the environment variables the hosts get from the launcher's own environment
/// (the token and [`LaunchRequest::host_env`]): values travel through Ray to each host's
/// environment, never through argv or the spec.
pub fn env_keys(req: &LaunchRequest) -> Vec<String> {
    let mut keys = vec!["TROUPE_TOKEN".to_string()];
    keys.extend(req.host_env.iter().map(|(k, _)| k.clone()));
    keys
}

/// The `troupe host` command line every host runs (the launcher adds `--host-index I`).
pub fn host_argv(req: &LaunchRequest, report_to: &str) -> Vec<String> {
    let mut c = vec![
        req.binary.display().to_string(),
        "host".into(),
        "--report-to".into(),
        report_to.to_string(),
        "--listen".into(),
        "0.0.0.0:0".into(),
    ];
    c.extend(req.host_flags());
    c
}

/// The launch spec, the first line of the launcher's stdin.
pub fn spec(o: &RayOptions, req: &LaunchRequest, report_to: &str, name: &str) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "address": o.address,
        "namespace": o.namespace,
        "strategy": o.strategy.as_str(),
        "n_hosts": req.n_hosts,
        "gpus_per_host": req.gpus_per_host,
        "cpus_per_host": o.cpus_per_host,
        "resources": o.resources,
        "runtime_env": o.runtime_env,
        "argv": host_argv(req, report_to),
        "env_keys": env_keys(req),
        "startup_timeout_s": req.startup_timeout.as_secs_f64(),
        "stop_grace_s": req.shutdown_grace.as_secs_f64() + 5.0,
        "fail_infeasible": o.fail_infeasible,
    })
}

/// One event of the launcher's Python half.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum RayEvent {
    /// The placement group was asked for.
    Placing {
        /// Its id.
        placement_group: String,
    },
    /// Ray placed every bundle.
    Placed {
        /// Its id.
        placement_group: String,
        /// Where each bundle landed.
        bundles: Vec<Bundle>,
    },
    /// A host actor started its `troupe host`.
    Started {
        /// Host index.
        index: usize,
        /// The host process.
        pid: u32,
        /// The actor's process (its parent).
        actor_pid: u32,
        /// Ray node id.
        node_id: String,
        /// The node's IP.
        node_ip: String,
        /// GPU ids Ray gave the actor.
        #[serde(default)]
        gpus: Vec<String>,
    },
    /// The launch cannot go on, in Ray's words.
    Error {
        /// Which host, when it concerns one.
        #[serde(default)]
        index: Option<usize>,
        /// What happened.
        message: String,
    },
    /// A host process exited.
    Exited {
        /// Host index.
        index: usize,
        /// Its exit code (`None`: killed by a signal).
        code: Option<i32>,
        /// Its last lines of output.
        #[serde(default)]
        tail: Vec<String>,
    },
    /// A host's actor died (killed, or its node lost), taking the host with it.
    Lost {
        /// Host index.
        index: usize,
        /// Ray's words.
        why: String,
    },
    /// The launcher stopped the hosts and removed the placement group.
    Done,
}

/// Where one bundle of the placement group landed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Bundle {
    /// Bundle (= host) index.
    pub index: usize,
    /// Ray node id.
    pub node_id: String,
    /// The node's IP.
    pub node_ip: String,
}

/// Parses one stdout line: `None` for lines that are not events (or not understood).
pub fn parse_event(line: &str) -> Option<RayEvent> {
    serde_json::from_str(line.strip_prefix(EVENT_PREFIX)?.trim()).ok()
}

/// A short node name for messages: the first 12 hex digits of a Ray node id.
pub fn short_node(id: &str) -> String {
    id.chars().take(12).collect()
}

/// Where the launcher's files go: a fresh private directory under the system temp dir.
pub fn work_dir() -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    std::env::temp_dir().join(format!("troupe-ray-{}-{stamp}-{n}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn req() -> LaunchRequest {
        LaunchRequest {
            n_hosts: 3,
            gpus_per_host: 1,
            token: Some("s3cret".into()),
            host_env: vec![("TROUPE_TLS_CERT".into(), "/c.pem".into())],
            heartbeat: Duration::from_millis(250),
            max_message_bytes: 64 << 20,
            shutdown_grace: Duration::from_secs(5),
            startup_timeout: Duration::from_secs(60),
            binary: "/opt/troupe".into(),
        }
    }

    #[test]
    fn the_spec_names_the_token_but_never_carries_it() {
        let o = RayOptions {
            strategy: RayStrategy::Pack,
            ..RayOptions::default()
        };
        let s = spec(&o, &req(), "10.0.0.1:4000", "troupe-x");
        let text = s.to_string();
        assert!(!text.contains("s3cret"), "{text}");
        assert_eq!(s["strategy"], "PACK");
        assert_eq!(
            s["env_keys"],
            serde_json::json!(["TROUPE_TOKEN", "TROUPE_TLS_CERT"])
        );
        let argv: Vec<String> = serde_json::from_value(s["argv"].clone()).unwrap();
        assert_eq!(
            argv[..6],
            [
                "/opt/troupe",
                "host",
                "--report-to",
                "10.0.0.1:4000",
                "--listen",
                "0.0.0.0:0"
            ]
        );
        assert!(!argv.iter().any(|a| a.contains("token")), "{argv:?}");
    }

    #[test]
    fn strategies_and_events_parse() {
        assert_eq!(
            RayStrategy::parse("strict_spread"),
            Ok(RayStrategy::StrictSpread)
        );
        let e = RayStrategy::parse("spready").unwrap_err();
        assert!(
            e.contains("scheduler.placement_strategy") && e.contains("PACK"),
            "{e}"
        );
        let ev = parse_event(r#"troupe-ray {"event": "lost", "index": 2, "why": "actor died"}"#);
        assert_eq!(
            ev,
            Some(RayEvent::Lost {
                index: 2,
                why: "actor died".into()
            })
        );
        let ev = parse_event(r#"troupe-ray {"event": "error", "message": "INFEASIBLE"}"#);
        assert!(
            matches!(ev, Some(RayEvent::Error { index: None, .. })),
            "{ev:?}"
        );
        assert_eq!(parse_event("2026-12-02 INFO worker.py: connected"), None);
        assert_eq!(parse_event("troupe-ray {not json"), None);
        assert_eq!(short_node("fda5a5edfb396658997136304306"), "fda5a5edfb39");
    }
}
