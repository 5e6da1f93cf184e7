//! What to launch: everything an InferenceServer needs to start one server instance.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Which server program (an inference [`Backend`]) and the server's role in PD disaggregation:
/// the words the scheduler, the router and the engine share, from `troupe-wire`.
pub use troupe_wire::{Backend, WorkerType};

/// Multi-node settings for an instance wider than one host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MultiNode {
    /// Hosts this instance spans.
    pub nnodes: u32,
    /// This host's rank among them.
    pub node_rank: u32,
    /// `host:port` of rank 0's rendezvous.
    pub dist_init_addr: String,
}

/// How to launch one server instance.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaunchSpec {
    /// Server program.
    pub backend: Backend,
    /// Regular, prefill or decode.
    pub worker_type: WorkerType,
    /// Model path (a local directory or checkpoint; for `troupe`, a model size or a safetensors file).
    pub model: String,
    /// Tensor parallel size.
    pub tp: u32,
    /// Pipeline parallel size.
    pub pp: u32,
    /// GPU ids of this host that the instance uses (its bundle); becomes `CUDA_VISIBLE_DEVICES`
    /// (with [`LaunchSpec::cpu`], CPU core ids instead).
    pub gpus: Vec<u32>,
    /// The server computes on CPU cores, not GPUs (vLLM's CPU backend): its placement slots are
    /// core ids, bound with `VLLM_CPU_OMP_THREADS_BIND` (two servers left to choose both take
    /// core 0 and each request costs 10× more).
    #[serde(default)]
    pub cpu: bool,
    /// Address to bind the HTTP server to.
    pub host: String,
    /// Address clients (and decode servers, for bootstrap) reach this host at.
    pub advertise_host: String,
    /// HTTP port.
    pub port: u16,
    /// Port for the server's own distributed init (SGLang `--nccl-port`).
    pub dist_port: Option<u16>,
    /// PD bootstrap port (prefill always; decode too, since SGLang decodes open one).
    pub bootstrap_port: Option<u16>,
    /// PD KV transfer backend (`mooncake`, `nixl`, `tcp` for troupe).
    pub transfer_backend: Option<String>,
    /// Multi-node flags, when the instance spans hosts.
    pub multi_node: Option<MultiNode>,
    /// `fp8` makes SGLang (and troupe) serve FP8 block-quantized weights.
    pub quantization: Option<String>,
    /// Extra server flags, appended verbatim.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Python interpreter for sglang / vllm.
    #[serde(default = "default_python")]
    pub python: String,
    /// The `troupe` executable for the troupe backend (default: the host's own executable).
    #[serde(default)]
    pub troupe_bin: Option<PathBuf>,
    /// Where the server's log goes (default: a file in this process's private run directory,
    /// `$TMPDIR/troupe-run-PID-RANDOM/`, see [`super::rundir`]).
    #[serde(default)]
    pub log_path: Option<PathBuf>,
    /// How long the server may take to become ready, in seconds.
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: f64,
    /// Admin API key passed to the server (control endpoints require it): in the environment
    /// for the reference engine, in a private config file for SGLang, never on the command line.
    #[serde(default)]
    pub admin_api_key: Option<String>,
    /// Wait for `/health` before reporting started. False for the non-head nodes of a
    /// multi-node instance, which serve no HTTP of their own.
    #[serde(default = "yes")]
    pub wait_ready: bool,
}

fn yes() -> bool {
    true
}

fn default_python() -> String {
    "python3".into()
}

fn default_ready_timeout() -> f64 {
    600.0
}

impl LaunchSpec {
    /// GPUs the instance occupies on this host.
    pub fn gpu_count(&self) -> u32 {
        self.gpus.len() as u32
    }

    /// `http://advertise_host:port`.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.advertise_host, self.port)
    }
}

/// A launch spec for unit tests: a TP-2 server on GPUs 4 and 5 of a fictional host, never
/// started (the port is never bound).
#[cfg(test)]
pub(crate) fn test_spec(backend: Backend, wt: WorkerType) -> LaunchSpec {
    LaunchSpec {
        backend,
        worker_type: wt,
        model: "/models/qwen".into(),
        tp: 2,
        pp: 1,
        gpus: vec![4, 5],
        cpu: false,
        host: "0.0.0.0".into(),
        advertise_host: "10.0.0.3".into(),
        port: 30000,
        dist_port: Some(30001),
        bootstrap_port: Some(30002),
        transfer_backend: Some("mooncake".into()),
        multi_node: None,
        quantization: None,
        extra_args: vec!["--mem-fraction-static".into(), "0.8".into()],
        env: BTreeMap::new(),
        python: "python3".into(),
        troupe_bin: None,
        log_path: None,
        ready_timeout_s: 60.0,
        admin_api_key: None,
        wait_ready: true,
    }
}
