//! The reference engine's integration tests, one binary (each file a module): request bounds,
//! connections, control routes, HTTP conformance, PD (auth, identity), the prefix cache, SGLang's
//! own router in front of it, vLLM's dialect and token routes, weight updates (BF16, FP8).

mod common;

mod bounds;
mod connections;
mod control;
mod http_conformance;
mod pd_auth;
mod pd_identity;
mod prefix_cache;
mod sglang_router;
mod vllm_dialect;
mod vllm_tokens;
mod weights_fp8;
mod weights_update;
