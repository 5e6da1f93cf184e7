//! What a fork is told and what it reports: its options (`ForkOptions`), its errors
//! (`ForkError`) and its progress (`ForkProgress`, `Progress`). Fork, routing, recovery,
//! `troupe plan` and setup all take them; they live here, below the fork, so that routing
//! (which the fork and the re-placer use) does not depend on the fork for them.

use std::sync::Arc;
use std::time::Duration;

use troupe_serving::gateway::GatewayConfig;

/// Why inference serving could not be brought up.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The plan does not fit the cluster, or has no inference component.
    #[error("placement: {0}")]
    Placement(String),
    /// Servers failed to start (all of them are listed).
    #[error("{failed} of {total} servers failed to start:\n{details}")]
    Servers {
        /// How many failed.
        failed: usize,
        /// How many were launched.
        total: usize,
        /// One paragraph per failure, with the server's log tail.
        details: String,
    },
    /// The gateway or a proxy failed to start.
    #[error("{0}")]
    Serving(String),
    /// Servers would listen on non-loopback addresses with their control endpoints open.
    #[error(
        "hosts {0} are not on this machine, so servers, proxies and the gateway listen on their network addresses: set an admin key (ForkOptions::admin_key, config `admin_key`) so their control endpoints are not open to the network"
    )]
    NoAdminKey(String),
}

/// How far a bring-up is: servers ready of all launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkProgress {
    /// Servers ready (the last report of a bring-up has `ready == total`).
    pub ready: usize,
    /// Servers launched.
    pub total: usize,
}

/// Where a bring-up reports its progress: a library reports, the CLI renders (a progress bar
/// on stderr). Cheap to clone; the default reports nowhere.
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<dyn Fn(ForkProgress) + Send + Sync>>);

impl Progress {
    /// Reports to `f`.
    pub fn to(f: impl Fn(ForkProgress) + Send + Sync + 'static) -> Self {
        Progress(Some(Arc::new(f)))
    }

    /// Sends `p` to the callback, if there is one (fork reports as servers come up).
    pub(super) fn report(&self, p: ForkProgress) {
        if let Some(f) = &self.0 {
            f(p);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Progress(reported)"
        } else {
            "Progress(none)"
        })
    }
}

/// How servers are launched (the parts of a config the plan does not say).
#[derive(Debug, Clone)]
pub struct ForkOptions {
    /// Model path (for the troupe backend also `tiny` / `small`).
    pub model: String,
    /// Python interpreter for sglang / vllm.
    pub python: String,
    /// `fp8` or none.
    pub quantization: Option<String>,
    /// Whether weight syncs send deltas (`weights.delta`).
    pub weights_delta: troupe_weights::delta::DeltaMode,
    /// The most bytes of tensors one bucket of a weight sync carries (`weights.bucket_mib`).
    pub weights_bucket_bytes: u64,
    /// Whether engines that can stage weight updates do (`weights.staging`).
    pub weights_staging: troupe_serving::control_plane::Staging,
    /// All servers at once, or a part at a time (`weights.rollout`, `weights.rolling_part`).
    pub weights_rollout: troupe_serving::control_plane::Rollout,
    /// How long a rolling update lets a part's requests finish before pausing it
    /// (`weights.rolling_drain_s`).
    pub weights_rolling_drain: Duration,
    /// PD transfer backend.
    pub transfer_backend: Option<String>,
    /// Extra server flags, verbatim, for every server.
    pub extra_args: Vec<String>,
    /// Flags from the config's `sglang:` engine fields, for SGLang and reference-engine
    /// servers (the reference engine ignores the ones it does not take, saying so once).
    pub sglang_args: Vec<String>,
    /// Flags from the config's `vllm:` engine fields, for vLLM servers.
    pub vllm_args: Vec<String>,
    /// Environment from the config's `vllm:` engine fields (secrets such as `HF_TOKEN`, which
    /// must not be flags), for vLLM servers.
    pub vllm_env: std::collections::BTreeMap<String, String>,
    /// The interpreter for vLLM servers (`vllm.python`; `None`: [`ForkOptions::python`]).
    pub vllm_python: Option<String>,
    /// vLLM servers run on CPU cores (`vllm.device: cpu`).
    pub vllm_cpu: bool,
    /// Readiness timeout per server.
    pub ready_timeout: Duration,
    /// Admin key for servers, proxies and gateway.
    pub admin_key: Option<String>,
    /// Gateway settings (policies, retries, health, breaker). An empty `listen` (the default
    /// here) puts the gateway on its host's own address, port 0 (`127.0.0.1:0` when every host
    /// is on this machine), so clients on other machines can reach it. Workers and the admin key
    /// are filled in by the fork.
    pub gateway: GatewayConfig,
    /// Where bring-up progress goes (the CLI draws a bar; nothing by default).
    pub progress: Progress,
    /// Restarts of a server whose process dies (same ports, so proxies and router find it).
    pub server_restarts: u32,
}

impl Default for ForkOptions {
    fn default() -> Self {
        ForkOptions {
            model: "tiny".into(),
            python: "python3".into(),
            quantization: None,
            weights_delta: troupe_weights::delta::DeltaMode::Auto,
            weights_bucket_bytes: troupe_weights::bucket::DEFAULT_BUCKET_BYTES,
            weights_staging: Default::default(),
            weights_rollout: Default::default(),
            weights_rolling_drain: Duration::from_secs(60),
            transfer_backend: None,
            extra_args: Vec::new(),
            sglang_args: Vec::new(),
            vllm_args: Vec::new(),
            vllm_env: Default::default(),
            vllm_python: None,
            vllm_cpu: false,
            ready_timeout: Duration::from_secs(600),
            admin_key: None,
            gateway: GatewayConfig {
                listen: String::new(),
                ..GatewayConfig::default()
            },
            progress: Progress::default(),
            server_restarts: 3,
        }
    }
}
