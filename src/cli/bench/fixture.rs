//! What the benchmarks that drive an in-process deployment share: prompt text made from a seed,
//! and a fresh deployment of reference engines per configuration measured.

use serde_json::Value;
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_scheduler::AllocationPlan;
use troupe_serving::policy::PolicyKind;

/// `len` lowercase letters from `seed` (xorshift): the same seed, the same text; another seed,
/// other text (so prompts share no prefix unless a benchmark means them to).
pub fn letters(seed: u64, len: u64) -> String {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (b'a' + (s % 26) as u8) as char
        })
        .collect()
}

/// A fresh one-host, 4-slot in-process cluster running `plan` of reference engines started with
/// `extra_args`, every gateway policy (regular, prefill, decode) set to `policy`.
pub async fn deployment(
    plan: &AllocationPlan,
    extra_args: Vec<String>,
    policy: PolicyKind,
) -> Result<(Cluster, Deployment), String> {
    let router = troupe_serving::RouterConfig {
        policy,
        prefill_policy: policy,
        decode_policy: policy,
        ..Default::default()
    };
    deployment_with(plan, extra_args, router).await
}

/// [`deployment`] with the gateway's whole router configuration (its policies' settings too).
pub async fn deployment_with(
    plan: &AllocationPlan,
    extra_args: Vec<String>,
    router: troupe_serving::RouterConfig,
) -> Result<(Cluster, Deployment), String> {
    let cluster = Cluster::in_process(1, 4)
        .await
        .map_err(|e| format!("cannot start the cluster: {e}"))?;
    let mut opts = ForkOptions {
        extra_args,
        ..ForkOptions::default()
    };
    opts.gateway.router = router;
    match Deployment::fork(&cluster, plan, &opts).await {
        Ok(svc) => Ok((cluster, svc)),
        Err(e) => {
            cluster.shutdown().await;
            Err(e.to_string())
        }
    }
}

/// The prompt, completion and cached token counts of one `/generate` answer's `meta_info`.
pub fn token_counts(answer: &Value) -> (u64, u64, u64) {
    let m = &answer["meta_info"];
    let n = |k: &str| m[k].as_u64().unwrap_or(0);
    (
        n("prompt_tokens"),
        n("completion_tokens"),
        n("cached_tokens"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_follow_the_seed() {
        assert_eq!(letters(7, 64), letters(7, 64));
        assert_ne!(letters(7, 64), letters(8, 64));
        assert_eq!(letters(0, 512).len(), 512);
        assert!(letters(3, 100).bytes().all(|b| b.is_ascii_lowercase()));
    }
}
