//! The reference engine's configuration, [`EngineArgs`]: one field per flag of `troupe engine`,
//! spelled like SGLang's `launch_server` so one launch-command builder serves both engines.
//!
//! The struct is plain data so in-process users (tests, embedded runs) build it without a
//! command-line parser; with the `cli` feature (which only the `troupe` binary's package turns
//! on) it also derives `clap::Args`, and the `arg` attributes below are the flags' one
//! definition. [`Default`] gives the same values as parsing an empty command line.

use std::path::PathBuf;
use std::time::Duration;

use troupe_weights::fp8::BlockSize;

use crate::core::LatencyModel;
use crate::error::EngineError;
use crate::model::ModelConfig;

/// Flags of the reference engine. Harmless SGLang-only flags (`--mem-fraction-static`,
/// `--base-gpu-id`, `--trust-remote-code`, ...) are accepted and ignored so a command line
/// built for SGLang also starts this engine.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EngineArgs {
    /// Address to serve HTTP on.
    #[cfg_attr(feature = "cli", arg(long, default_value = "127.0.0.1"))]
    pub host: String,
    /// HTTP port (0 picks a free one).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 30000))]
    pub port: u16,
    /// Model size preset: `tiny` or `small`.
    #[cfg_attr(feature = "cli", arg(long, default_value = "tiny"))]
    pub model: String,
    /// Optional safetensors file (or directory holding `model.safetensors`) to load instead of
    /// the seeded initialisation. Reported as `model_path`.
    #[cfg_attr(feature = "cli", arg(long))]
    pub model_path: Option<PathBuf>,
    /// Tensor-parallel size: reported, and the number of weight-update ranks this engine
    /// covers; the forward pass runs on CPU threads regardless.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1))]
    pub tp_size: u32,
    /// Data-parallel size (only 1 is supported).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1))]
    pub dp_size: u32,
    /// `null` (regular), `prefill` or `decode`.
    #[cfg_attr(feature = "cli", arg(long, default_value = "null"))]
    pub disaggregation_mode: String,
    /// Prefill: port of the KV bootstrap listener (0 picks a free one). Decode: the port used
    /// when a request's `bootstrap_port` is null.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 8998))]
    pub disaggregation_bootstrap_port: u16,
    /// KV transfer backend; only `tcp` exists here.
    #[cfg_attr(feature = "cli", arg(long, default_value = "tcp"))]
    pub disaggregation_transfer_backend: String,
    /// Decode: how long to wait for a prefill's KV before giving up on a request (seconds).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 300.0))]
    pub disaggregation_kv_timeout_s: f64,
    /// Prefill: how long an unfetched room's KV is kept (seconds).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 300.0))]
    pub disaggregation_prefill_keep_s: f64,
    /// The deployment's KV-handoff secret: prefill and decode servers of one deployment prove
    /// it to each other before KV flows, so a request cannot point a decode at another
    /// deployment's prefill. Give it through the environment (argv is visible to every user).
    #[cfg_attr(feature = "cli", arg(
        long,
        env = troupe_wire::env::BOOTSTRAP_SECRET,
        hide_env_values = true,
        hide = true
    ))]
    pub disaggregation_bootstrap_secret: Option<String>,
    /// Most requests in the running batch.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 64))]
    pub max_running_requests: usize,
    /// KV token pool (SGLang's `--max-total-tokens`): running requests' KV plus the prefix
    /// cache. Default: the context length times `--max-running-requests`.
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_total_tokens: Option<usize>,
    /// Turn the prefix (radix) cache off: every request computes its whole prompt.
    #[cfg_attr(feature = "cli", arg(long))]
    pub disable_radix_cache: bool,
    /// Seed for weight initialisation and for requests without `sampling_seed`.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub random_seed: u64,
    /// Bearer key required on every endpoint except health and metrics.
    #[cfg_attr(feature = "cli", arg(long))]
    pub api_key: Option<String>,
    /// Bearer key required on control-plane endpoints (pause, weights, memory, flush).
    #[cfg_attr(feature = "cli", arg(long, env = troupe_wire::env::ENGINE_ADMIN_KEY, hide_env_values = true))]
    pub admin_api_key: Option<String>,
    /// Accept `/release_memory_occupation` and `/resume_memory_occupation`.
    #[cfg_attr(feature = "cli", arg(long))]
    pub enable_memory_saver: bool,
    /// Latency model: prefill throughput in tokens/s (off by default).
    #[cfg_attr(feature = "cli", arg(long))]
    pub sim_prefill_tokens_per_s: Option<f64>,
    /// Latency model: fixed decode step time in ms (off by default).
    #[cfg_attr(feature = "cli", arg(long))]
    pub sim_decode_step_ms: Option<f64>,
    /// Latency model: extra decode step time per running request in ms.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub sim_decode_per_seq_ms: f64,
    /// Simulated model-load time: wait this many seconds before serving (like a GPU server
    /// loading weights), so bring-up benchmarks of many servers mean something.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub sim_startup_delay_s: f64,
    /// Simulated weight-load time: committing a staged weight update (or loading weights from
    /// disk) takes this many more seconds, while the engine is paused for it, as loading new
    /// weights into a GPU server does; for benchmarks of weight updates under load.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub sim_weight_load_s: f64,
    /// Simulated per-bucket load time: every bucket of a weight update (staged or applied)
    /// takes this many more milliseconds, as copying a large bucket into a GPU does; lets
    /// tests and benchmarks catch an update between buckets.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub sim_bucket_load_ms: f64,
    /// Name reported by `/v1/models` (defaults to `troupe-<model>`).
    #[cfg_attr(feature = "cli", arg(long))]
    pub served_model_name: Option<String>,
    /// Initial weight version label.
    #[cfg_attr(feature = "cli", arg(long, default_value = "default"))]
    pub weight_version: String,
    /// Timeout for joining a weight-update group and for each bucket (seconds).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 120.0))]
    pub weights_update_timeout_s: f64,
    /// Ignored (SGLang GPU memory fraction).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub mem_fraction_static: Option<f64>,
    /// Ignored (SGLang first GPU id).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub base_gpu_id: Option<u32>,
    /// Ignored.
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub trust_remote_code: bool,
    /// Ignored.
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub skip_server_warmup: bool,
    /// Ignored (log level comes from RUST_LOG).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub log_level: Option<String>,
    /// Ignored (multi-node flags; the reference engine is one process).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub dist_init_addr: Option<String>,
    /// Ignored.
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub nnodes: Option<u32>,
    /// Ignored.
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub node_rank: Option<u32>,
    /// Ignored (SGLang context length; the model preset fixes it).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub context_length: Option<usize>,
    /// Ignored (SGLang's NCCL port; the reference engine runs its TP ranks in one process).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub nccl_port: Option<u16>,
    /// Pipeline parallel size: reported only, like --tp-size.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1, hide = true))]
    pub pp_size: u32,
    /// SGLang's model-config overrides as JSON; must parse as a JSON object (the FP8
    /// `quantization_config` travels here).
    #[cfg_attr(feature = "cli", arg(long, hide = true))]
    pub json_model_override_args: Option<String>,
    /// Quantization: `fp8` (or `none`). The reference engine computes in f32 either way; FP8
    /// weight updates (`float8_e4m3fn` plus their scales) are accepted and dequantized on load,
    /// and `quantization_config.weight_block_size` from `--json-model-override-args` (default
    /// `[128, 128]`) says how block scales tile a weight.
    #[cfg_attr(feature = "cli", arg(long))]
    pub quantization: Option<String>,
}

// Each value here must be its flag's `default_value` above (the `cli` feature's test
// `default_is_an_empty_command_line` checks it): an engine built in process then behaves like
// `troupe engine` started with no flags.
impl Default for EngineArgs {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 30000,
            model: "tiny".into(),
            model_path: None,
            tp_size: 1,
            dp_size: 1,
            disaggregation_mode: "null".into(),
            disaggregation_bootstrap_port: 8998,
            disaggregation_transfer_backend: "tcp".into(),
            disaggregation_kv_timeout_s: 300.0,
            disaggregation_prefill_keep_s: 300.0,
            disaggregation_bootstrap_secret: None,
            max_running_requests: 64,
            max_total_tokens: None,
            disable_radix_cache: false,
            random_seed: 0,
            api_key: None,
            admin_api_key: None,
            enable_memory_saver: false,
            sim_prefill_tokens_per_s: None,
            sim_decode_step_ms: None,
            sim_decode_per_seq_ms: 0.0,
            sim_startup_delay_s: 0.0,
            sim_weight_load_s: 0.0,
            sim_bucket_load_ms: 0.0,
            served_model_name: None,
            weight_version: "default".into(),
            weights_update_timeout_s: 120.0,
            mem_fraction_static: None,
            base_gpu_id: None,
            trust_remote_code: false,
            skip_server_warmup: false,
            log_level: None,
            dist_init_addr: None,
            nnodes: None,
            node_rank: None,
            context_length: None,
            nccl_port: None,
            pp_size: 1,
            json_model_override_args: None,
            quantization: None,
        }
    }
}

/// Serving role (`--disaggregation-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisaggMode {
    /// Regular server.
    Null,
    /// PD prefill server.
    Prefill,
    /// PD decode server.
    Decode,
}

impl DisaggMode {
    /// SGLang's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// Longest duration any `*-s` flag takes: a week (past it a value is a typo such as `1e20`,
/// which `Duration` cannot even hold).
const MAX_SECS: f64 = 7.0 * 24.0 * 3600.0;

/// Longest simulated cost of one step, in milliseconds: a minute.
const MAX_SIM_MS: f64 = 60_000.0;

/// Whether `host` names only this machine (so no admin key is needed to listen on it).
fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn secs(v: f64, flag: &str) -> Result<Duration, EngineError> {
    if v.is_finite() && v > 0.0 && v <= MAX_SECS {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(EngineError::Config(format!(
            "{flag} must be a positive number of seconds up to {MAX_SECS} (a week), got {v}"
        )))
    }
}

/// Flags after validation.
#[derive(Debug, Clone)]
pub struct Validated {
    /// Model architecture.
    pub config: ModelConfig,
    /// Serving role.
    pub mode: DisaggMode,
    /// Latency model.
    pub latency: LatencyModel,
    /// Decode KV wait.
    pub kv_timeout: Duration,
    /// Prefill room keep time.
    pub prefill_keep: Duration,
    /// Weight-update join/bucket timeout.
    pub weights_timeout: Duration,
}

impl EngineArgs {
    /// The KV-handoff secret, if one was given.
    pub fn bootstrap_secret(&self) -> Option<crate::pd::auth::Secret> {
        crate::pd::auth::Secret::new(
            self.disaggregation_bootstrap_secret
                .as_deref()
                .unwrap_or_default(),
        )
    }

    /// The KV token pool: `--max-total-tokens`, or the context length times
    /// `--max-running-requests` (saturating, so no flag value overflows).
    pub fn kv_pool_tokens(&self, config: &ModelConfig) -> usize {
        self.max_total_tokens.unwrap_or_else(|| {
            config
                .max_position_embeddings
                .saturating_mul(self.max_running_requests)
        })
    }

    /// Checks every flag; errors name the flag and the accepted values.
    pub fn validate(&self) -> Result<Validated, EngineError> {
        if let Some(j) = &self.json_model_override_args
            && !matches!(
                serde_json::from_str::<serde_json::Value>(j),
                Ok(serde_json::Value::Object(_))
            )
        {
            return Err(EngineError::Config(format!(
                "--json-model-override-args must be a JSON object, e.g. '{{\"quantization_config\": {{...}}}}'; got {j:?}"
            )));
        }
        let key = self.admin_api_key.as_deref().is_some_and(|k| !k.is_empty());
        if !key && !is_loopback(&self.host) {
            return Err(EngineError::Config(format!(
                "refusing to listen on {} without an admin key: anyone who reaches it could pause the engine or replace its weights; set TROUPE_ENGINE_ADMIN_KEY (or --admin-api-key), or listen on 127.0.0.1",
                self.host
            )));
        }
        if self.pp_size == 0 {
            return Err(EngineError::Config("--pp-size must be at least 1".into()));
        }
        let config = ModelConfig::by_name(&self.model).ok_or_else(|| {
            EngineError::Config(format!(
                "--model {:?} is not a preset; use --model tiny or --model small",
                self.model
            ))
        })?;
        let mode = match self.disaggregation_mode.as_str() {
            "null" | "none" | "" => DisaggMode::Null,
            "prefill" => DisaggMode::Prefill,
            "decode" => DisaggMode::Decode,
            other => {
                return Err(EngineError::Config(format!(
                    "--disaggregation-mode {other:?} is invalid; use null, prefill or decode"
                )));
            }
        };
        if self.disaggregation_transfer_backend != "tcp" {
            return Err(EngineError::Config(format!(
                "--disaggregation-transfer-backend {:?} is not available in the reference engine; use tcp",
                self.disaggregation_transfer_backend
            )));
        }
        if self.tp_size == 0 {
            return Err(EngineError::Config("--tp-size must be at least 1".into()));
        }
        if self.dp_size != 1 {
            return Err(EngineError::Config(format!(
                "--dp-size {} is not supported; run several engines instead (--dp-size 1)",
                self.dp_size
            )));
        }
        if self.max_running_requests == 0 {
            return Err(EngineError::Config(
                "--max-running-requests must be at least 1".into(),
            ));
        }
        if self.max_total_tokens == Some(0) {
            return Err(EngineError::Config(
                "--max-total-tokens must be at least 1 (omit it for the default pool)".into(),
            ));
        }
        if let Some(q) = &self.quantization
            && q != "none"
            && q != "fp8"
        {
            return Err(EngineError::Config(format!(
                "--quantization {q} is not supported by the reference engine; use --quantization fp8 or omit it"
            )));
        }
        self.fp8_block_size()?;
        if let Some(v) = self.sim_prefill_tokens_per_s
            && !(v.is_finite() && (v == 0.0 || (1.0..=1e12).contains(&v)))
        {
            return Err(EngineError::Config(format!(
                "--sim-prefill-tokens-per-s must be 0 (off) or from 1 to 1e12 tokens per second, got {v}"
            )));
        }
        for (v, flag) in [
            (self.sim_decode_step_ms, "--sim-decode-step-ms"),
            (Some(self.sim_decode_per_seq_ms), "--sim-decode-per-seq-ms"),
            (Some(self.sim_bucket_load_ms), "--sim-bucket-load-ms"),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && (0.0..=MAX_SIM_MS).contains(&v))
            {
                return Err(EngineError::Config(format!(
                    "{flag} must be from 0 to {MAX_SIM_MS} milliseconds, got {v}"
                )));
            }
        }
        if !(self.sim_weight_load_s.is_finite() && (0.0..=3600.0).contains(&self.sim_weight_load_s))
        {
            return Err(EngineError::Config(format!(
                "--sim-weight-load-s must be between 0 and 3600 seconds, got {}",
                self.sim_weight_load_s
            )));
        }
        if !(self.sim_startup_delay_s.is_finite()
            && (0.0..=3600.0).contains(&self.sim_startup_delay_s))
        {
            return Err(EngineError::Config(format!(
                "--sim-startup-delay-s must be between 0 and 3600 seconds, got {}",
                self.sim_startup_delay_s
            )));
        }
        if let Some(p) = &self.model_path
            && !p.exists()
        {
            return Err(EngineError::Config(format!(
                "--model-path {} does not exist; give a local safetensors file or directory (or omit it for seeded weights)",
                p.display()
            )));
        }
        Ok(Validated {
            config,
            mode,
            latency: LatencyModel {
                prefill_tokens_per_s: self.sim_prefill_tokens_per_s.filter(|v| *v > 0.0),
                decode_step_ms: self.sim_decode_step_ms,
                decode_per_seq_ms: self.sim_decode_per_seq_ms,
                weight_load_s: self.sim_weight_load_s,
                bucket_load_ms: self.sim_bucket_load_ms,
            },
            kv_timeout: secs(
                self.disaggregation_kv_timeout_s,
                "--disaggregation-kv-timeout-s",
            )?,
            prefill_keep: secs(
                self.disaggregation_prefill_keep_s,
                "--disaggregation-prefill-keep-s",
            )?,
            weights_timeout: secs(self.weights_update_timeout_s, "--weights-update-timeout-s")?,
        })
    }

    /// Block size of FP8 block scales (`<name>.weight_scale_inv`) in weight updates: SGLang's
    /// `quantization_config.weight_block_size` from `--json-model-override-args`, else the
    /// DeepSeek / Hugging Face default of 128x128. Without it the engine could not tell how a
    /// scale grid maps onto a weight (several block sizes give the same grid shape).
    pub fn fp8_block_size(&self) -> Result<BlockSize, EngineError> {
        let flag = "--json-model-override-args";
        let Some(j) = &self.json_model_override_args else {
            return Ok(BlockSize::DEFAULT);
        };
        let v: serde_json::Value = serde_json::from_str(j)
            .map_err(|e| EngineError::Config(format!("{flag} must be a JSON object: {e}")))?;
        let Some(qc) = v.get("quantization_config") else {
            return Ok(BlockSize::DEFAULT);
        };
        if let Some(m) = qc.get("quant_method")
            && m.as_str() != Some("fp8")
        {
            return Err(EngineError::Config(format!(
                "{flag}: quantization_config.quant_method {m} is not supported; use \"fp8\""
            )));
        }
        let Some(b) = qc.get("weight_block_size") else {
            return Ok(BlockSize::DEFAULT);
        };
        let dims = b.as_array().filter(|a| a.len() == 2).and_then(|a| {
            let r = a[0].as_u64().and_then(|x| usize::try_from(x).ok())?;
            let c = a[1].as_u64().and_then(|x| usize::try_from(x).ok())?;
            BlockSize::new(r, c).ok()
        });
        dims.ok_or_else(|| {
            EngineError::Config(format!(
                "{flag}: quantization_config.weight_block_size must be two positive integers like [128, 128], got {b}"
            ))
        })
    }

    /// The name `/v1/models` reports.
    pub fn served_name(&self) -> String {
        self.served_model_name
            .clone()
            .unwrap_or_else(|| format!("troupe-{}", self.model))
    }
}

// The tests parse real command lines, so they need the `cli` feature (on for this crate's own
// tests through its dev-dependency on itself).
#[cfg(all(test, feature = "cli"))]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EngineArgs,
    }

    #[test]
    fn parses_sglang_style_flags() {
        let cli = Cli::try_parse_from([
            "x",
            "--port",
            "0",
            "--model",
            "small",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "9000",
            "--mem-fraction-static",
            "0.8",
            "--base-gpu-id",
            "2",
            "--tp-size",
            "2",
            "--trust-remote-code",
        ])
        .unwrap();
        let v = cli.args.validate().unwrap();
        assert_eq!(v.mode, DisaggMode::Prefill);
        assert_eq!(v.config.name, "small");
        assert_eq!(cli.args.disaggregation_bootstrap_port, 9000);
    }

    #[test]
    fn fp8_quantization_and_block_size() {
        let cli = Cli::try_parse_from([
            "x",
            "--quantization",
            "fp8",
            "--json-model-override-args",
            r#"{"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 32]}}"#,
        ])
        .unwrap();
        cli.args.validate().unwrap();
        assert_eq!(
            cli.args.fp8_block_size().unwrap(),
            BlockSize::new(64, 32).unwrap()
        );
        assert_eq!(
            EngineArgs::default().fp8_block_size().unwrap(),
            BlockSize::DEFAULT
        );
        for bad in [
            r#"{"quantization_config": {"weight_block_size": [0, 128]}}"#,
            r#"{"quantization_config": {"weight_block_size": 128}}"#,
            r#"{"quantization_config": {"quant_method": "awq"}}"#,
        ] {
            let cli = Cli::try_parse_from(["x", "--json-model-override-args", bad]).unwrap();
            let err = cli.args.validate().unwrap_err().to_string();
            assert!(err.contains("--json-model-override-args"), "{err}");
        }
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (flag, val) in [
            ("--model", "huge"),
            ("--disaggregation-mode", "both"),
            ("--disaggregation-transfer-backend", "mooncake"),
            ("--max-running-requests", "0"),
            ("--model-path", "/definitely/not/here"),
            ("--quantization", "awq"),
        ] {
            let cli = Cli::try_parse_from(["x", flag, val]).unwrap();
            let err = cli.args.validate().unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
    }

    #[test]
    fn default_is_an_empty_command_line() {
        let mut parsed = Cli::try_parse_from(["x"]).unwrap().args;
        // Two flags also read the environment; only their absence matters here.
        for (var, value) in [
            (
                troupe_wire::env::ENGINE_ADMIN_KEY,
                &mut parsed.admin_api_key,
            ),
            (
                troupe_wire::env::BOOTSTRAP_SECRET,
                &mut parsed.disaggregation_bootstrap_secret,
            ),
        ] {
            if std::env::var_os(var).is_some() {
                *value = None;
            }
        }
        assert_eq!(parsed, EngineArgs::default());
    }
}
