//! Building a server's command line: one place, one three-way branch on the worker type.
//!
//! SGLang's and the reference engine's flags are spelled the same on purpose, so the PD branch
//! is shared; vLLM differs in names and has no PD mode here.

use std::collections::BTreeMap;

use super::spec::{Backend, LaunchSpec, WorkerType};

/// A program, its arguments and extra environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandLine {
    /// Executable.
    pub program: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
}

impl CommandLine {
    /// The value following `flag`, if present (for tests and logs).
    pub fn flag(&self, flag: &str) -> Option<&str> {
        let i = self.args.iter().position(|a| a == flag)?;
        self.args.get(i + 1).map(String::as_str)
    }

    /// Whether `flag` is present.
    pub fn has(&self, flag: &str) -> bool {
        self.args.iter().any(|a| a == flag)
    }
}

/// FP8 block-wise quantization config in the form SGLang reads from
/// `--json-model-override-args` (DeepSeek / Hugging Face convention).
pub fn fp8_override_json() -> String {
    serde_json::json!({
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]
        }
    })
    .to_string()
}

/// Why a spec cannot be launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

/// Builds the command line for `spec`.
pub fn build(spec: &LaunchSpec, troupe_bin: &str) -> Result<CommandLine, SpecError> {
    if spec.tp == 0 || spec.pp == 0 {
        return Err(SpecError("tp and pp must be at least 1".into()));
    }
    let mut a: Vec<String> = Vec::new();
    let push = |a: &mut Vec<String>, k: &str, v: String| {
        a.push(k.to_string());
        a.push(v);
    };
    let mut env = spec.env.clone();
    if !spec.gpus.is_empty() {
        let ids: Vec<String> = spec.gpus.iter().map(u32::to_string).collect();
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.join(","));
    }
    let program = match spec.backend {
        Backend::Sglang | Backend::Troupe => {
            let program = if spec.backend == Backend::Sglang {
                a.extend(["-m".into(), "sglang.launch_server".into()]);
                spec.python.clone()
            } else {
                a.push("engine".into());
                troupe_bin.to_string()
            };
            if spec.backend == Backend::Troupe && matches!(spec.model.as_str(), "tiny" | "small") {
                // The reference engine's built-in model sizes (seeded weights, no file).
                push(&mut a, "--model", spec.model.clone());
            } else {
                push(&mut a, "--model-path", spec.model.clone());
            }
            push(&mut a, "--host", spec.host.clone());
            push(&mut a, "--port", spec.port.to_string());
            push(&mut a, "--tp-size", spec.tp.to_string());
            if spec.pp > 1 {
                push(&mut a, "--pp-size", spec.pp.to_string());
            }
            // CUDA_VISIBLE_DEVICES already narrows the GPUs to the bundle: count from 0.
            push(&mut a, "--base-gpu-id", "0".into());
            if let Some(p) = spec.dist_port {
                push(&mut a, "--nccl-port", p.to_string());
            }
            if let Some(m) = &spec.multi_node {
                push(&mut a, "--dist-init-addr", m.dist_init_addr.clone());
                push(&mut a, "--nnodes", m.nnodes.to_string());
                push(&mut a, "--node-rank", m.node_rank.to_string());
            }
            match spec.worker_type {
                WorkerType::Regular => {}
                WorkerType::Train => {
                    return Err(SpecError(
                        "a training rank is not an inference server; launch regular, prefill or decode workers".into(),
                    ));
                }
                WorkerType::Prefill | WorkerType::Decode => {
                    push(
                        &mut a,
                        "--disaggregation-mode",
                        spec.worker_type.as_str().into(),
                    );
                    let port = spec.bootstrap_port.ok_or_else(|| {
                        SpecError(format!(
                            "a {} server needs its own bootstrap port",
                            spec.worker_type.as_str()
                        ))
                    })?;
                    push(&mut a, "--disaggregation-bootstrap-port", port.to_string());
                    if let Some(t) = &spec.transfer_backend {
                        push(&mut a, "--disaggregation-transfer-backend", t.clone());
                    }
                }
            }
            if let Some(q) = &spec.quantization {
                push(&mut a, "--quantization", q.clone());
                if q == "fp8" {
                    push(&mut a, "--json-model-override-args", fp8_override_json());
                }
            }
            if let Some(k) = &spec.admin_api_key {
                push(&mut a, "--admin-api-key", k.clone());
            }
            program
        }
        Backend::Fsdp | Backend::Megatron | Backend::Archon => {
            return Err(SpecError(format!(
                "{} is a training backend, not an inference server; use sglang, vllm or troupe",
                spec.backend
            )));
        }
        Backend::Vllm => {
            if spec.worker_type != WorkerType::Regular {
                return Err(SpecError(
                    "vLLM servers are launched as regular workers only; use sglang or troupe for prefill/decode groups".into(),
                ));
            }
            a.extend(["-m".into(), "vllm.entrypoints.openai.api_server".into()]);
            push(&mut a, "--model", spec.model.clone());
            push(&mut a, "--host", spec.host.clone());
            push(&mut a, "--port", spec.port.to_string());
            push(&mut a, "--tensor-parallel-size", spec.tp.to_string());
            push(&mut a, "--pipeline-parallel-size", spec.pp.to_string());
            if let Some(q) = &spec.quantization {
                push(&mut a, "--quantization", q.clone());
            }
            if let Some(p) = spec.dist_port {
                env.insert("VLLM_PORT".into(), p.to_string());
            }
            spec.python.clone()
        }
    };
    a.extend(spec.extra_args.iter().cloned());
    Ok(CommandLine {
        program,
        args: a,
        env,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::spec::MultiNode;

    fn spec(backend: Backend, wt: WorkerType) -> LaunchSpec {
        LaunchSpec {
            backend,
            worker_type: wt,
            model: "/models/qwen".into(),
            tp: 2,
            pp: 1,
            gpus: vec![4, 5],
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

    #[test]
    fn sglang_regular_has_no_pd_flags() {
        let c = build(&spec(Backend::Sglang, WorkerType::Regular), "troupe").unwrap();
        assert_eq!(c.program, "python3");
        assert_eq!(&c.args[..2], ["-m", "sglang.launch_server"]);
        assert_eq!(c.flag("--model-path"), Some("/models/qwen"));
        assert_eq!(c.flag("--tp-size"), Some("2"));
        assert_eq!(c.flag("--port"), Some("30000"));
        assert_eq!(c.flag("--nccl-port"), Some("30001"));
        assert_eq!(c.flag("--base-gpu-id"), Some("0"));
        assert_eq!(
            c.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
            Some("4,5")
        );
        assert!(!c.has("--disaggregation-mode"));
        assert!(!c.has("--disaggregation-bootstrap-port"));
        assert_eq!(c.flag("--mem-fraction-static"), Some("0.8"));
    }

    #[test]
    fn sglang_prefill_and_decode_each_get_mode_and_own_bootstrap_port() {
        for wt in [WorkerType::Prefill, WorkerType::Decode] {
            let c = build(&spec(Backend::Sglang, wt), "troupe").unwrap();
            assert_eq!(c.flag("--disaggregation-mode"), Some(wt.as_str()));
            assert_eq!(c.flag("--disaggregation-bootstrap-port"), Some("30002"));
            assert_eq!(
                c.flag("--disaggregation-transfer-backend"),
                Some("mooncake")
            );
        }
        let mut s = spec(Backend::Sglang, WorkerType::Prefill);
        s.bootstrap_port = None;
        assert!(
            build(&s, "troupe")
                .unwrap_err()
                .0
                .contains("bootstrap port")
        );
    }

    #[test]
    fn multi_node_and_fp8_flags() {
        let mut s = spec(Backend::Sglang, WorkerType::Regular);
        s.multi_node = Some(MultiNode {
            nnodes: 2,
            node_rank: 1,
            dist_init_addr: "10.0.0.1:5000".into(),
        });
        s.quantization = Some("fp8".into());
        let c = build(&s, "troupe").unwrap();
        assert_eq!(c.flag("--dist-init-addr"), Some("10.0.0.1:5000"));
        assert_eq!(c.flag("--nnodes"), Some("2"));
        assert_eq!(c.flag("--node-rank"), Some("1"));
        assert_eq!(c.flag("--quantization"), Some("fp8"));
        let j: serde_json::Value =
            serde_json::from_str(c.flag("--json-model-override-args").unwrap()).unwrap();
        assert_eq!(
            j["quantization_config"]["weight_block_size"],
            serde_json::json!([128, 128])
        );
        assert_eq!(j["quantization_config"]["fmt"], "e4m3");
    }

    #[test]
    fn troupe_backend_runs_troupe_engine_with_the_same_flags() {
        let c = build(&spec(Backend::Troupe, WorkerType::Decode), "/bin/troupe").unwrap();
        assert_eq!(c.program, "/bin/troupe");
        assert_eq!(c.args[0], "engine");
        assert_eq!(c.flag("--disaggregation-mode"), Some("decode"));
    }

    #[test]
    fn vllm_uses_its_own_flag_names_and_refuses_pd() {
        let c = build(&spec(Backend::Vllm, WorkerType::Regular), "troupe").unwrap();
        assert_eq!(&c.args[..2], ["-m", "vllm.entrypoints.openai.api_server"]);
        assert_eq!(c.flag("--model"), Some("/models/qwen"));
        assert_eq!(c.flag("--tensor-parallel-size"), Some("2"));
        assert!(!c.has("--tp-size"));
        assert!(build(&spec(Backend::Vllm, WorkerType::Prefill), "troupe").is_err());
    }
}
