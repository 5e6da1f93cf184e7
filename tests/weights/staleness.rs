//! The staleness bound is a hard one, on the real path (a PD deployment of reference engines
//! on an in-process cluster, weights updated while rollouts generate): every trajectory the
//! controller hands to the train step at version `v` has its oldest token from version
//! `v − N` or newer, for N = 0, 1, 2, with a slow trainer and with generation interrupted by
//! weight updates (aborted and resubmitted). Trajectories that would break it are dropped,
//! counted, and regenerated (or not, by `StalePolicy`).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{client, pd_deployment, until, within};
use tokio::sync::watch;
use troupe_controller::Cluster;
use troupe_controller::rollout::{
    Generation, InferenceClient, RolloutController, RolloutError, RolloutOptions, RolloutWorkflow,
    Sample, SamplingSettings, StalePolicy, Trajectory, WaitError, staleness_of,
};
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_serving::inference::WorkerType;
use troupe_wire::WeightVersion;

/// A PD deployment (1 prefill, 2 decode; 4 ms decode steps).
struct Pd {
    cluster: Cluster,
    svc: Deployment,
    http: reqwest::Client,
}

impl Pd {
    async fn start() -> Pd {
        let opts = ForkOptions {
            extra_args: vec!["--sim-decode-step-ms".into(), "4".into()],
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 4, "troupe:(prefill:d1t1|decode:d2t1)", &opts).await;
        Pd {
            cluster,
            svc,
            http: client(),
        }
    }

    fn controller(&self, max_staleness: u64, batch_size: usize) -> RolloutController {
        RolloutController::new(
            InferenceClient::new(self.svc.gateway_url.clone()),
            RolloutOptions {
                max_concurrent: 16,
                max_staleness,
                batch_size,
            },
        )
    }

    /// What a trainer step of `troupe run` ends with: new weights on every engine through the
    /// deployment's control plane (in-flight requests are aborted and resubmitted), then the
    /// controller's version.
    async fn update(&self, rc: &RolloutController, version: u64) {
        let (_, tensors) = common::model::trainer_weights(100 + version);
        self.svc
            .plane
            .update_from_tensors(&version.to_string(), &tensors)
            .await
            .unwrap();
        rc.set_version(version);
    }

    /// Requests in the decode engines' running batches (each has its first token already).
    async fn decoding(&self) -> u64 {
        let mut n = 0;
        for s in self.svc.servers() {
            if s.info.worker_type != WorkerType::Decode {
                continue;
            }
            let loads: serde_json::Value = self
                .http
                .get(format!("{}/v1/loads", s.info.url))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            n += loads["loads"][0]["num_running_reqs"].as_u64().unwrap();
        }
        n
    }

    async fn stop(self) {
        self.svc.teardown().await;
        self.cluster.shutdown().await;
    }
}

/// One data item: `tokens` per turn; with `gate_at`, a second turn that waits until the
/// trainer reaches that version (a slow environment step), so the trajectory finishes late.
#[derive(Debug, Clone)]
struct Item {
    id: u64,
    tokens: usize,
    gate_at: Option<u64>,
}

/// Every generation an attempt of an item made, consumed or not.
#[derive(Debug, Clone)]
struct Attempt {
    id: u64,
    versions: Vec<u64>,
}

/// Generates through the gateway and logs every attempt; the reward is the item id, so a
/// batch says which items it holds.
struct Logged {
    log: Arc<Mutex<Vec<Attempt>>>,
    trainer_version: watch::Receiver<u64>,
    parked: Arc<AtomicUsize>,
}

impl Logged {
    fn new(trainer_version: watch::Receiver<u64>) -> Arc<Self> {
        Arc::new(Logged {
            log: Arc::default(),
            trainer_version,
            parked: Arc::default(),
        })
    }

    fn attempts(&self, id: u64) -> Vec<Attempt> {
        let log = self.log.lock().unwrap();
        log.iter().filter(|a| a.id == id).cloned().collect()
    }

    fn sample(&self, id: u64, prompt: Vec<u32>, g: Generation) -> Sample {
        let versions: Vec<u64> = g
            .versions
            .iter()
            .map(|v| v.as_ref().map_or(0, WeightVersion::step))
            .collect();
        self.log.lock().unwrap().push(Attempt {
            id,
            versions: versions.clone(),
        });
        Sample {
            prompt_ids: prompt,
            output_ids: g.output_ids,
            logprobs: g.logprobs,
            versions,
            reward: id as f32,
        }
    }
}

impl RolloutWorkflow for Logged {
    type Item = Item;

    async fn run_episode(
        &self,
        engine: &InferenceClient,
        item: Item,
    ) -> Result<Option<Trajectory>, RolloutError> {
        let s = SamplingSettings {
            max_new_tokens: item.tokens,
            ignore_eos: true,
            seed: Some(item.id),
            ..SamplingSettings::default()
        };
        let prompt = vec![72, 105, 32, 60 + (item.id % 50) as u32];
        let g = engine.generate(&prompt, &s).await?;
        let mut next = prompt.clone();
        next.extend(&g.output_ids);
        let mut samples = vec![self.sample(item.id, prompt, g)];
        if let Some(open) = item.gate_at {
            self.parked.fetch_add(1, Ordering::SeqCst);
            let mut v = self.trainer_version.clone();
            let opened = v.wait_for(|v| *v >= open).await.is_ok();
            self.parked.fetch_sub(1, Ordering::SeqCst);
            if !opened {
                return Err(RolloutError::Workflow("the test ended".into()));
            }
            let g = engine.generate(&next, &s).await?;
            samples.push(self.sample(item.id, next, g));
        }
        Ok(Some(Trajectory { samples }))
    }
}

fn ids(batch: &[Trajectory]) -> Vec<u64> {
    batch.iter().map(|t| t.samples[0].reward as u64).collect()
}

/// Every item is submitted up front, so generation runs as far ahead as admission allows; the
/// trainer is slow (each update waits until every admitted rollout has ended). With N ≥ 1,
/// item 0 is late: its second turn waits for version N + 1, so it would be trained on with its
/// first turn's version-0 tokens N + 1 versions old.
async fn slow_trainer(n: u64) {
    let b = 2;
    let steps = n + 3;
    let pd = Pd::start().await;
    let rc = pd.controller(n, b);
    let (version_tx, version_rx) = watch::channel(0);
    let wf = Logged::new(version_rx);
    for id in 0..steps * b as u64 {
        let gate_at = (id == 0 && n > 0).then_some(n + 1);
        rc.submit(
            Item {
                id,
                tokens: 12,
                gate_at,
            },
            wf.clone(),
        );
    }
    let mut trained = Vec::new();
    let mut max_seen = 0;
    for v in 0..steps {
        let batch = rc.wait(b, Duration::from_secs(120)).await.unwrap();
        let stale = staleness_of(&batch, v);
        assert!(stale <= n, "N = {n}, step {v}: staleness {stale}");
        max_seen = max_seen.max(stale);
        trained.extend(ids(&batch));
        let (rc_ref, parked) = (&rc, &wf.parked);
        until("every admitted rollout ended or parked", || async move {
            rc_ref.stats().running == parked.load(Ordering::SeqCst)
        })
        .await;
        pd.update(&rc, v + 1).await;
        version_tx.send_replace(v + 1);
    }
    assert_eq!(
        max_seen, n,
        "generation ran ahead as far as the bound allows, no further"
    );
    trained.sort_unstable();
    assert_eq!(
        trained,
        (0..steps * b as u64).collect::<Vec<_>>(),
        "every item trained on exactly once: the late one was regenerated, nothing was lost"
    );
    let st = rc.stats();
    assert_eq!(st.failed, 0, "{:?}", st.last_error);
    let late = if n > 0 { 1 } else { 0 };
    assert_eq!(
        st.stale_dropped, late,
        "only the late trajectory was dropped"
    );
    if n > 0 {
        let attempts = wf.attempts(0);
        assert_eq!(attempts.len(), 4, "two turns dropped, two regenerated");
        assert!(attempts[0].versions.iter().all(|&v| v == 0));
        for a in &attempts[1..] {
            assert!(a.versions.iter().all(|&v| v > n), "{attempts:?}");
        }
    }
    rc.shutdown();
    pd.stop().await;
}

#[tokio::test]
async fn slow_trainer_synchronous_rl_stays_on_policy() {
    within(240, slow_trainer(0)).await
}

#[tokio::test]
async fn slow_trainer_a_late_trajectory_is_regenerated_with_bound_1() {
    within(240, slow_trainer(1)).await
}

#[tokio::test]
async fn slow_trainer_a_late_trajectory_is_regenerated_with_bound_2() {
    within(240, slow_trainer(2)).await
}

/// A fast trainer: N + 1 weight updates land while a batch is generating, so its requests are
/// aborted and resubmitted and their tokens span versions 0..=N+1. At version N + 1 their
/// oldest tokens (version 0) are too old, however fresh the newest are: the controller drops
/// them and (by `policy`) regenerates them. Then N updates land during the next batch: its
/// staleness is exactly N, which the bound allows.
async fn interrupted(n: u64, policy: StalePolicy) {
    let b = 2;
    let long = 160; // tokens per request: still generating when the updates land
    let pd = Pd::start().await;
    let rc = pd.controller(n, b).with_stale_policy(policy);
    let (_version_tx, version_rx) = watch::channel(0);
    let wf = Logged::new(version_rx);
    let submit = |ids: std::ops::Range<u64>| {
        for id in ids {
            let item = Item {
                id,
                tokens: long,
                gate_at: None,
            };
            rc.submit(item, wf.clone());
        }
    };

    submit(0..b as u64);
    let pd_ref = &pd;
    until("both requests are decoding", || async move {
        pd_ref.decoding().await == b as u64
    })
    .await;
    for v in 1..=n + 1 {
        pd.update(&rc, v).await;
    }
    let first = rc.wait(b, Duration::from_secs(120)).await;
    let firsts: Vec<Attempt> = (0..b as u64).map(|id| wf.attempts(id)[0].clone()).collect();
    for a in &firsts {
        assert_eq!(a.versions.len(), long, "resubmitted to full length");
        assert_eq!(a.versions.iter().min(), Some(&0), "started under version 0");
    }
    assert!(
        firsts.iter().any(|a| a.versions.iter().max() > Some(&0)),
        "generation was interrupted: newer tokens after the update did not save it: {firsts:?}"
    );
    match policy {
        StalePolicy::Regenerate => {
            let batch = first.unwrap();
            assert_eq!(
                staleness_of(&batch, n + 1),
                0,
                "regenerated at version N + 1"
            );
            let mut got = ids(&batch);
            got.sort_unstable();
            assert_eq!(got, vec![0, 1]);
        }
        StalePolicy::Drop => {
            assert!(
                matches!(first, Err(WaitError::Starved { have: 0, .. })),
                "dropped items are not generated again: {first:?}"
            );
            assert_eq!(wf.log.lock().unwrap().len(), b, "nothing was regenerated");
        }
    }
    assert_eq!(
        rc.stats().stale_dropped,
        b as u64,
        "both first attempts were too stale"
    );

    if n > 0 {
        let v0 = n + 1;
        submit(b as u64..2 * b as u64);
        until("both requests are decoding", || async move {
            pd_ref.decoding().await == b as u64
        })
        .await;
        for v in v0 + 1..=v0 + n {
            pd.update(&rc, v).await;
        }
        let batch = rc.wait(b, Duration::from_secs(120)).await.unwrap();
        assert_eq!(
            staleness_of(&batch, v0 + n),
            n,
            "N versions old is within the bound"
        );
        assert_eq!(
            rc.stats().stale_dropped,
            b as u64,
            "nothing more was dropped"
        );
    }
    assert_eq!(rc.stats().failed, 0, "{:?}", rc.stats().last_error);
    rc.shutdown();
    pd.stop().await;
}

#[tokio::test]
async fn interrupted_generation_is_as_old_as_its_oldest_token_bound_0() {
    within(240, interrupted(0, StalePolicy::Regenerate)).await
}

#[tokio::test]
async fn interrupted_generation_is_as_old_as_its_oldest_token_bound_1() {
    within(240, interrupted(1, StalePolicy::Regenerate)).await
}

#[tokio::test]
async fn interrupted_generation_is_as_old_as_its_oldest_token_bound_2() {
    within(240, interrupted(2, StalePolicy::Regenerate)).await
}

#[tokio::test]
async fn interrupted_generation_under_the_drop_policy_is_dropped_not_regenerated() {
    within(240, interrupted(1, StalePolicy::Drop)).await
}
