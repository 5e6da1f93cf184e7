//! Asynchronous rollouts: the staleness bound, a full pipeline, and weight updates mid-flight.
//! (The bound on the real path, with interrupted generation: `staleness.rs`.)

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use common::{generated_tokens, pd_deployment, until, within};
use proptest::prelude::*;
use tokio::sync::watch;
use troupe_controller::rollout::{
    InferenceClient, RlvrItem, RlvrWorkflow, RolloutController, RolloutError, RolloutOptions,
    RolloutWorkflow, Sample, SamplingSettings, StalePolicy, Trajectory, WaitError, capacity,
    staleness_of,
};
use troupe_controller::serve::ForkOptions;
use troupe_serving::control_plane::{Engine, WeightSync, WeightSyncOptions};

proptest! {
    #[test]
    fn capacity_respects_both_bounds(
        max_concurrent in 1usize..64, staleness in 0u64..4, batch in 1usize..16,
        version in 0u64..10, accepted in 0u64..200, running in 0usize..80,
    ) {
        let c = capacity(max_concurrent, staleness, batch, version, accepted, running);
        prop_assert!(running + c <= max_concurrent.max(running));
        let budget = (staleness + version + 1) * batch as u64;
        prop_assert!(accepted + running as u64 + c as u64 <= budget.max(accepted + running as u64));
        // More versions never shrink capacity; more running never grows it.
        prop_assert!(capacity(max_concurrent, staleness, batch, version + 1, accepted, running) >= c);
        prop_assert!(capacity(max_concurrent, staleness, batch, version, accepted, running + 1) <= c);
    }
}

#[test]
fn synchronous_rl_admits_exactly_one_batch_per_version() {
    assert_eq!(capacity(100, 0, 8, 0, 0, 0), 8);
    assert_eq!(capacity(100, 0, 8, 0, 8, 0), 0);
    assert_eq!(capacity(100, 0, 8, 1, 8, 0), 8);
    assert_eq!(capacity(4, 0, 8, 0, 0, 0), 4, "concurrency caps it too");
}

/// A workflow that takes a while and records how many episodes run at once.
struct Slow {
    version: Arc<AtomicU64>,
    running: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl RolloutWorkflow for Slow {
    type Item = u64;
    async fn run_episode(
        &self,
        _e: &InferenceClient,
        item: u64,
    ) -> Result<Option<Trajectory>, RolloutError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let v = self.version.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(15)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        if item % 7 == 3 {
            return Ok(None); // dropped items free their slot
        }
        Ok(Some(Trajectory {
            samples: vec![Sample {
                prompt_ids: vec![1],
                output_ids: vec![2],
                logprobs: vec![-1.0],
                versions: vec![v],
                reward: 0.0,
            }],
        }))
    }
}

#[tokio::test]
async fn prepare_batch_keeps_the_pipeline_full_within_the_bounds() {
    within(60, async {
        let (batch, max_concurrent, max_staleness) = (8, 6, 1);
        let wf = Arc::new(Slow {
            version: Arc::default(),
            running: Arc::default(),
            peak: Arc::default(),
        });
        let rc = RolloutController::new(
            InferenceClient::new("http://unused.invalid"),
            RolloutOptions {
                max_concurrent,
                max_staleness,
                batch_size: batch,
            },
        );
        let mut data = 0u64..;
        for step in 0..6u64 {
            let b = rc
                .prepare_batch(&mut data, wf.clone(), Duration::from_secs(20))
                .await
                .unwrap();
            assert_eq!(b.len(), batch);
            assert!(
                staleness_of(&b, step) <= max_staleness,
                "step {step}: staleness {}",
                staleness_of(&b, step)
            );
            let st = rc.stats();
            assert!(
                st.running + st.waiting + st.ready > 0,
                "the next batch is already in flight"
            );
            assert!(st.accepted + st.running as u64 <= (max_staleness + step + 1) * batch as u64);
            tokio::time::sleep(Duration::from_millis(30)).await; // "training"
            wf.version.store(step + 1, Ordering::SeqCst);
            rc.set_version(step + 1);
        }
        assert!(wf.peak.load(Ordering::SeqCst) <= max_concurrent);
        assert!(
            rc.stats().rejected > 0,
            "dropped items were seen and did not count as accepted"
        );
    })
    .await
}

/// No engine: a token's version is `engine`'s when it is "generated". Item 0 is late: its
/// second token waits for `gate`, so it spans versions.
struct Late {
    engine: Arc<AtomicU64>,
    gate: watch::Receiver<bool>,
    parked: Arc<AtomicUsize>,
}

impl RolloutWorkflow for Late {
    type Item = u64;
    async fn run_episode(
        &self,
        _e: &InferenceClient,
        item: u64,
    ) -> Result<Option<Trajectory>, RolloutError> {
        let first = self.engine.load(Ordering::SeqCst);
        if item == 0 {
            self.parked.fetch_add(1, Ordering::SeqCst);
            let opened = self.gate.clone().wait_for(|open| *open).await.is_ok();
            self.parked.fetch_sub(1, Ordering::SeqCst);
            if !opened {
                return Err(RolloutError::Workflow("the test ended".into()));
            }
        }
        Ok(Some(Trajectory {
            samples: vec![Sample {
                prompt_ids: vec![1],
                output_ids: vec![2, 3],
                logprobs: vec![-1.0, -1.0],
                versions: vec![first, self.engine.load(Ordering::SeqCst)],
                reward: item as f32,
            }],
        }))
    }
}

/// `prepare_batch` with bound 1: item 0 starts under version 0 and ends under version 2, so
/// its oldest token is 2 versions old when it could be consumed. Either policy drops it and
/// still returns full batches within the bound; `Regenerate` trains on item 0 (generated
/// again), `Drop` never does and takes the next data items instead.
async fn late_item_under(policy: StalePolicy) {
    let (b, bound) = (2, 1);
    let (open, gate) = watch::channel(false);
    let wf = Arc::new(Late {
        engine: Arc::default(),
        gate,
        parked: Arc::default(),
    });
    let rc = RolloutController::new(
        InferenceClient::new("http://unused.invalid"),
        RolloutOptions {
            max_concurrent: 8,
            max_staleness: bound,
            batch_size: b,
        },
    )
    .with_stale_policy(policy);
    let mut data = 0u64..;
    let mut trained = Vec::new();
    for v in 0..6u64 {
        let batch = rc
            .prepare_batch(&mut data, wf.clone(), Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!(batch.len(), b);
        assert!(staleness_of(&batch, v) <= bound, "step {v}: {batch:?}");
        trained.extend(batch.iter().map(|t| t.samples[0].reward as u64));
        until("every admitted episode ended or parked", || async {
            rc.stats().running == wf.parked.load(Ordering::SeqCst)
        })
        .await;
        wf.engine.store(v + 1, Ordering::SeqCst);
        rc.set_version(v + 1);
        open.send_replace(v + 1 >= 2);
    }
    let mut unique = trained.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        trained.len(),
        "no item trained on twice: {trained:?}"
    );
    assert_eq!(
        rc.stats().stale_dropped,
        1,
        "only the late trajectory was dropped"
    );
    match policy {
        StalePolicy::Regenerate => assert!(trained.contains(&0), "{trained:?}"),
        StalePolicy::Drop => assert!(!trained.contains(&0), "{trained:?}"),
    }
    rc.shutdown();
}

#[tokio::test]
async fn a_late_trajectory_is_regenerated_and_the_batch_still_fills() {
    within(60, late_item_under(StalePolicy::Regenerate)).await
}

#[tokio::test]
async fn a_late_trajectory_is_dropped_and_the_next_items_fill_the_batch() {
    within(60, late_item_under(StalePolicy::Drop)).await
}

/// A workflow that records no versions: its tokens count as generated by the weights of the
/// version it was admitted at.
struct Unversioned;

impl RolloutWorkflow for Unversioned {
    type Item = ();
    async fn run_episode(
        &self,
        _e: &InferenceClient,
        _item: (),
    ) -> Result<Option<Trajectory>, RolloutError> {
        Ok(Some(Trajectory {
            samples: vec![Sample {
                prompt_ids: vec![1],
                output_ids: vec![2],
                logprobs: vec![-1.0],
                versions: vec![],
                reward: 0.0,
            }],
        }))
    }
}

#[tokio::test]
async fn unrecorded_versions_are_the_admission_version_and_a_dropped_item_can_starve_a_wait() {
    within(30, async {
        let rc = RolloutController::new(
            InferenceClient::new("http://unused.invalid"),
            RolloutOptions {
                max_concurrent: 4,
                max_staleness: 0,
                batch_size: 1,
            },
        )
        .with_stale_policy(StalePolicy::Drop);
        rc.submit((), Arc::new(Unversioned));
        until("the episode finished", || async { rc.stats().ready == 1 }).await;
        rc.set_version(1);
        assert_eq!(rc.stats().stale_dropped, 1);
        assert_eq!(rc.stats().ready, 0);
        let r = rc.wait(1, Duration::from_secs(10)).await;
        assert!(matches!(r, Err(WaitError::Starved { .. })), "{r:?}");
    })
    .await
}

/// A workflow that cannot work (every episode fails at once).
struct Broken;

impl RolloutWorkflow for Broken {
    type Item = u64;
    async fn run_episode(
        &self,
        _e: &InferenceClient,
        _item: u64,
    ) -> Result<Option<Trajectory>, RolloutError> {
        Err(RolloutError::Workflow("401 from /sessions".into()))
    }
}

#[tokio::test]
async fn a_workflow_that_always_fails_ends_prepare_batch_with_its_error() {
    within(30, async {
        let rc = RolloutController::new(
            InferenceClient::new("http://unused.invalid"),
            RolloutOptions {
                max_concurrent: 4,
                max_staleness: 1,
                batch_size: 2,
            },
        );
        // Endless data: without the bound the call would take item after item forever.
        let mut data = 0u64..;
        let r = rc
            .prepare_batch(&mut data, Arc::new(Broken), Duration::from_secs(20))
            .await;
        match r {
            Err(WaitError::Failing { failed, last_error }) => {
                assert!(failed > 64 && failed < 200, "{failed}");
                assert!(last_error.contains("401 from /sessions"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    })
    .await
}

#[tokio::test]
async fn paused_admission_starts_nothing_until_resumed() {
    within(30, async {
        let wf = Arc::new(Slow {
            version: Arc::default(),
            running: Arc::default(),
            peak: Arc::default(),
        });
        let rc = RolloutController::new(
            InferenceClient::new("http://unused.invalid"),
            RolloutOptions {
                max_concurrent: 4,
                max_staleness: 0,
                batch_size: 4,
            },
        );
        rc.pause();
        for i in 0..4 {
            rc.submit(i * 7, wf.clone());
        }
        assert_eq!(rc.stats().running, 0);
        assert_eq!(rc.stats().waiting, 4);
        rc.resume();
        let b = rc.wait(4, Duration::from_secs(10)).await.unwrap();
        assert_eq!(b.len(), 4);
    })
    .await
}

#[tokio::test]
async fn a_weight_update_during_rollouts_yields_mixed_versions_and_no_failures() {
    within(180, async {
        let opts = ForkOptions {
            extra_args: vec!["--sim-decode-step-ms".into(), "4".into()],
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 4, "troupe:(prefill:d1t1|decode:d2t1)", &opts).await;
        let rc = RolloutController::new(
            InferenceClient::new(svc.gateway_url.clone()),
            RolloutOptions {
                max_concurrent: 16,
                max_staleness: 4,
                batch_size: 8,
            },
        );
        let wf = Arc::new(RlvrWorkflow {
            n_samples: 2,
            sampling: SamplingSettings {
                max_new_tokens: 48,
                temperature: 1.0,
                ignore_eos: true,
                ..Default::default()
            },
            reward: Arc::new(|_p: &[u32], o: &[u32]| o.len() as f32),
        });
        for i in 0..8u64 {
            rc.submit(
                RlvrItem {
                    prompt_ids: vec![72, 105, 32, (i % 50) as u32 + 60],
                    seed: i,
                },
                wf.clone(),
            );
        }
        // The update lands while generation is under way: wait until the engines have
        // generated some tokens (not for a fixed time).
        let urls: Vec<String> = svc.servers().iter().map(|s| s.info.url.clone()).collect();
        until("the engines generated 8 tokens", || async {
            let mut total = 0;
            for u in &urls {
                total += generated_tokens(u).await;
            }
            total >= 8
        })
        .await;
        let (_, tensors) = common::model::trainer_weights(77);
        let engines: Vec<Engine> = svc
            .servers()
            .iter()
            .map(|s| Engine::sglang(s.info.url.clone(), s.info.gpu_count))
            .collect();
        WeightSync::new(WeightSyncOptions::default())
            .update_weights(&svc.control, &engines, &common::version("1"), &tensors)
            .await
            .unwrap();
        rc.set_version(1);
        let batch = rc.wait(8, Duration::from_secs(120)).await.unwrap();
        assert_eq!(rc.stats().failed, 0);
        let mut mixed = 0;
        for t in &batch {
            for s in &t.samples {
                assert_eq!(
                    s.output_ids.len(),
                    48,
                    "interrupted requests were resubmitted to full length"
                );
                assert_eq!(s.versions.len(), 48);
                if s.versions.contains(&0) && s.versions.contains(&1) {
                    mixed += 1;
                }
            }
        }
        assert!(
            mixed > 0,
            "some samples straddle the update: their tokens show the switch"
        );
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
