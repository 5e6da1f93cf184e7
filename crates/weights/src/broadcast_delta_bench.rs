//! Full against delta weight syncs after one optimizer step (`troupe bench broadcast
//! --changed F`).
//!
//! The step: every BF16 value of the model independently, with probability `F`, moves one
//! unit in the last place up or down. That is what an optimizer step much smaller than BF16's
//! rounding step does to the BF16 copy of FP32 master weights: a value crosses a rounding
//! boundary with probability proportional to how far it moved, and then by exactly one ulp;
//! which values cross is scattered over every tensor (verl measured 1-3% per RL step). With
//! `--fp8` both versions are quantized inside the timed sync, as in a real one, and the delta is
//! taken on the quantized bytes and scales.
//!
//! Each mode syncs version 0 to fresh receivers first (whole: nobody holds anything), then
//! version 1 (the first delta), then the timed sync of version 2, a second step: the steady
//! state of a training loop, where the sender's memory freed by the step before is there to
//! quantize into (timing the first delta instead charges it the page faults of a whole fresh
//! copy, since it still holds version 0 as its base while it quantizes version 1: 20-25% of
//! an FP8 sync to 8 receivers with the binary's allocator). Every receiver's copy is checked
//! byte for byte against version 2.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use half::bf16;
use rayon::prelude::*;

use crate::broadcast_bench::{MAX_MIB, MAX_RECEIVERS, Model, RUNS, TIMEOUT_SECS, WireTensor};
use crate::broadcast_bench::{encode, model_tensors, receive};
use crate::bucket::{DEFAULT_BUCKET_BYTES, TensorMeta, pack_buckets};
use crate::delta::{DeltaStats, SenderBases};
use crate::tcp::{SharedTensorRef, WeightSender};

const TIMEOUT: Duration = Duration::from_secs(TIMEOUT_SECS);

/// Syncs per mode: the last one is timed.
const SYNCS: usize = 3;

/// The versions of the model and what each sync sends.
struct Versions {
    models: Vec<Model>,
    /// Encoded last version: what every receiver must end with.
    expected: Vec<WireTensor>,
    /// Every version encoded, in buffers the sender may keep (BF16 runs only; FP8 runs
    /// quantize inside each sync).
    shared: Option<Vec<Vec<Bytes>>>,
    buckets: Vec<Vec<usize>>,
}

/// Measures full and delta syncs of about `mib` MiB to each count in `receivers` after a step
/// that changed a fraction `changed` of the BF16 values (with `link_gbps`, every receiver reads
/// its chain link no faster than a link of that many Gb/s: what the syncs cost between
/// machines), and returns `(metric, value)` pairs
/// per count `n`: `broadcast.full.receivers_<n>.seconds`, `broadcast.delta.receivers_<n>.seconds`
/// (best of the rounds, quantizing included with `fp8`), `broadcast.full.receivers_<n>.bytes_sent`,
/// `broadcast.delta.receivers_<n>.bytes_sent` (bytes written to each data link, frames
/// included), `broadcast.delta.receivers_<n>.speedup` (full over delta seconds); and once,
/// `broadcast.changed` (the fraction asked for) and `broadcast.delta.changed_seen` (the
/// fraction of wire elements the delta found changed: of BF16 values, or with `fp8` of FP8
/// bytes and scales).
pub async fn bench_broadcast_delta(
    receivers: &[usize],
    mib: usize,
    fp8: bool,
    ring: Option<usize>,
    changed: f64,
    link_gbps: Option<f64>,
) -> Result<Vec<(String, f64)>, String> {
    if receivers.is_empty() || receivers.iter().any(|&n| n == 0 || n > MAX_RECEIVERS) {
        return Err(format!(
            "receivers must be a non-empty list of counts between 1 and {MAX_RECEIVERS}; got {receivers:?}"
        ));
    }
    if mib == 0 || mib > MAX_MIB {
        return Err(format!("mib must be between 1 and {MAX_MIB}; got {mib}"));
    }
    if !(changed > 0.0 && changed <= 1.0) {
        return Err(format!(
            "changed is the fraction of values a step changes, in (0, 1], e.g. 0.02; got {changed}"
        ));
    }
    if let Some(g) = link_gbps {
        if ring.is_some() {
            return Err(
                "a link rate applies to the TCP chain; the ring is memory (add --chain)".into(),
            );
        }
        crate::tcp::pace::Pace::gbps(g).map_err(|e| e.to_string())?;
    }
    let versions = tokio::task::spawn_blocking(move || versions(mib, fp8, changed))
        .await
        .map_err(|e| format!("making the model failed: {e}"))??;
    let versions = Arc::new(versions);
    let mut best = vec![[(f64::INFINITY, 0u64); 2]; receivers.len()];
    let mut seen = DeltaStats::default();
    for _ in 0..RUNS {
        for (k, &n) in receivers.iter().enumerate() {
            for (m, delta) in [false, true].into_iter().enumerate() {
                let (secs, bytes, stats) =
                    measure(n, fp8, ring, delta, link_gbps, versions.clone()).await?;
                let b = &mut best[k][m];
                *b = (b.0.min(secs), bytes);
                if delta {
                    seen = stats;
                }
            }
        }
    }
    let mut out = vec![("broadcast.changed".to_string(), changed)];
    if let Some(g) = link_gbps {
        out.push(("broadcast.link_gbps".to_string(), g));
    }
    if let Some(f) = seen.changed_fraction() {
        out.push(("broadcast.delta.changed_seen".to_string(), f));
    }
    for (&n, [full, delta]) in receivers.iter().zip(&best) {
        out.push((format!("broadcast.full.receivers_{n}.seconds"), full.0));
        out.push((format!("broadcast.delta.receivers_{n}.seconds"), delta.0));
        out.push((
            format!("broadcast.full.receivers_{n}.bytes_sent"),
            full.1 as f64,
        ));
        out.push((
            format!("broadcast.delta.receivers_{n}.bytes_sent"),
            delta.1 as f64,
        ));
        out.push((
            format!("broadcast.delta.receivers_{n}.speedup"),
            full.0 / delta.0,
        ));
    }
    Ok(out)
}

fn versions(mib: usize, fp8: bool, changed: f64) -> Result<Versions, String> {
    let mut models = vec![model_tensors(mib)];
    for k in 1..SYNCS {
        models.push(step(&models[k - 1], changed, k as u64));
    }
    let expected = encode(&models[SYNCS - 1], fp8, None)?;
    let shared = if fp8 {
        None
    } else {
        let bytes = |w: &[WireTensor]| w.iter().map(|t| Bytes::copy_from_slice(&t.bytes)).collect();
        let mut all = Vec::with_capacity(SYNCS);
        for m in &models[..SYNCS - 1] {
            all.push(bytes(&encode(m, false, None)?));
        }
        all.push(bytes(&expected));
        Some(all)
    };
    let metas = expected
        .iter()
        .map(|t| TensorMeta::new(t.name.clone(), t.dtype, t.shape.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let index: std::collections::HashMap<&str, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let buckets = pack_buckets(metas, DEFAULT_BUCKET_BYTES)
        .map_err(|e| e.to_string())?
        .iter()
        .map(|b| b.tensors.iter().map(|t| index[t.name.as_str()]).collect())
        .collect();
    Ok(Versions {
        models,
        expected,
        shared,
        buckets,
    })
}

/// Optimizer step number `k` as described in the module docs.
fn step(model: &Model, changed: f64, k: u64) -> Model {
    model
        .par_iter()
        .enumerate()
        .map(|(i, (name, shape, values))| {
            let mut s = 0x2545_F491_4F6C_DD1D_u64
                ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ k.wrapping_mul(0xD6E8_FEB8_6659_FD93);
            let threshold = (changed * (1u64 << 53) as f64) as u64;
            let v = values
                .iter()
                .map(|&x| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    let bits = x.to_bits();
                    if (s >> 11) >= threshold || bits & 0x7F80 == 0x7F80 {
                        return x;
                    }
                    let up = (s >> 5) & 1 == 1;
                    bf16::from_bits(if up || bits & 0x7FFF == 0 {
                        bits.wrapping_add(1)
                    } else {
                        bits - 1
                    })
                })
                .collect();
            (name.clone(), shape.clone(), v)
        })
        .collect()
}

/// One mode at one receiver count: versions 0 and 1 (untimed), then version 2 timed. Returns
/// the time, the bytes written to a data link for version 2, and the delta's statistics over
/// versions 1 and 2.
async fn measure(
    n: usize,
    fp8: bool,
    ring: Option<usize>,
    delta: bool,
    link_gbps: Option<f64>,
    v: Arc<Versions>,
) -> Result<(f64, u64, DeltaStats), String> {
    let mut sender = WeightSender::bind("127.0.0.1:0", n + 1, "bench")
        .await
        .map_err(|e| e.to_string())?;
    sender.set_bucket_timeout(TIMEOUT);
    sender.set_shared_memory(ring).map_err(|e| e.to_string())?;
    sender.set_delta(delta.then(|| Arc::new(Mutex::new(SenderBases::new(false)))));
    let addr = sender.local_addr().map_err(|e| e.to_string())?.to_string();
    let key = sender.secret();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (addr, key, v) = (addr.clone(), key.clone(), v.clone());
        tasks.push(tokio::spawn(async move {
            receive(
                (&addr, &key),
                i as u32 + 1,
                &v.expected,
                &v.buckets,
                SYNCS,
                link_gbps,
            )
            .await
        }));
    }
    sender
        .accept_all(Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let (mut timed, mut sent) = (0.0, 0);
    // What the deltas found over both steps (a tensor that went plain in the first is not
    // diffed again in the second).
    let mut seen = DeltaStats::default();
    for run in 0..SYNCS {
        let start = Instant::now();
        // FP8 quantizes inside the timed sync; BF16 sends the encodings made up front. Both
        // hand the sender buffers it may keep, as `WeightSync` does.
        let quantized: Option<Vec<Bytes>> = if fp8 {
            let v = v.clone();
            let w = tokio::task::spawn_blocking(move || {
                encode(&v.models[run], true, None)
                    .map(|w| w.into_iter().map(|t| Bytes::from(t.bytes)).collect())
            })
            .await
            .map_err(|e| format!("quantizing failed: {e}"))??;
            Some(w)
        } else {
            None
        };
        let bytes: &[Bytes] = match (&quantized, &v.shared) {
            (Some(w), _) => w,
            (None, Some(s)) => &s[run],
            (None, None) => return Err("internal: no encodings".into()),
        };
        for b in &v.buckets {
            let refs: Vec<SharedTensorRef<'_>> = b
                .iter()
                .map(|&i| SharedTensorRef {
                    name: &v.expected[i].name,
                    dtype: v.expected[i].dtype,
                    shape: &v.expected[i].shape,
                    bytes: &bytes[i],
                })
                .collect();
            sender
                .send_bucket_shared(&refs)
                .await
                .map_err(|e| format!("{n} receivers: {e}"))?;
        }
        let took = start.elapsed().as_secs_f64();
        let stats = sender.take_stats();
        if run > 0 {
            seen.add(&stats);
        }
        if run + 1 == SYNCS {
            (timed, sent) = (took, stats.sent_bytes);
        }
    }
    for t in tasks {
        t.await.map_err(|e| format!("receiver task: {e}"))??;
    }
    sender.close().await.map_err(|e| e.to_string())?;
    Ok((timed, sent, seen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delta_bench_reports_both_modes_and_checks_bytes() {
        let r = tokio::time::timeout(Duration::from_secs(120), async {
            for fp8 in [false, true] {
                let out = bench_broadcast_delta(&[1, 2], 2, fp8, None, 0.02, None)
                    .await
                    .unwrap();
                let get = |k: &str| out.iter().find(|(n, _)| n == k).map(|(_, v)| *v).unwrap();
                for n in [1, 2] {
                    let full = get(&format!("broadcast.full.receivers_{n}.bytes_sent"));
                    let delta = get(&format!("broadcast.delta.receivers_{n}.bytes_sent"));
                    assert!(delta * 4.0 < full, "fp8 {fp8}: delta {delta} full {full}");
                    assert!(get(&format!("broadcast.delta.receivers_{n}.seconds")) > 0.0);
                }
                let seen = get("broadcast.delta.changed_seen");
                assert!(seen > 0.0 && seen < 0.2, "seen {seen}");
            }
            assert!(
                bench_broadcast_delta(&[1], 2, false, None, 0.0, None)
                    .await
                    .is_err()
            );
            assert!(
                bench_broadcast_delta(&[1], 2, false, None, 1.5, None)
                    .await
                    .is_err()
            );
        })
        .await;
        r.expect("bench test timed out");
    }

    /// A paced link holds every sync to its rate (a lower bound only, so a slow machine cannot
    /// fail it), and a rate that is not one, or a ring, is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paced_link_takes_at_least_its_time() {
        let r = tokio::time::timeout(Duration::from_secs(120), async {
            let out = bench_broadcast_delta(&[1], 2, false, None, 0.02, Some(0.5))
                .await
                .unwrap();
            let get = |k: &str| out.iter().find(|(n, _)| n == k).map(|(_, v)| *v).unwrap();
            assert_eq!(get("broadcast.link_gbps"), 0.5);
            for mode in ["full", "delta"] {
                let bytes = get(&format!("broadcast.{mode}.receivers_1.bytes_sent"));
                let secs = get(&format!("broadcast.{mode}.receivers_1.seconds"));
                // The receiver waits out each payload read at 6.25e7 bytes/s (headers, a few
                // bytes per tensor, are not paced), less the slack a link keeps from the sync
                // before; unpaced, 2 MiB take about a millisecond.
                let slack = crate::tcp::pace::IDLE.as_secs_f64();
                let paced = 0.9 * bytes / 6.25e7 - slack;
                assert!(secs >= paced, "{mode}: {secs} s for {bytes} bytes");
            }
            for bad in [0.0, -3.0, f64::NAN] {
                assert!(
                    bench_broadcast_delta(&[1], 2, false, None, 0.02, Some(bad))
                        .await
                        .is_err()
                );
            }
            let ring = bench_broadcast_delta(&[1], 2, false, Some(1 << 20), 0.02, Some(10.0)).await;
            assert!(ring.unwrap_err().contains("--chain"));
        })
        .await;
        r.expect("paced bench test timed out");
    }
}
