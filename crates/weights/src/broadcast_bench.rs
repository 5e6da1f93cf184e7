//! Throughput of the chain broadcast as the number of engines grows (`troupe bench broadcast`).
//!
//! Real TCP on loopback and a real shared-memory ring ([`crate::tcp::shm`]), with in-process
//! receivers running the real [`WeightReceiver`] code (no engine around it). Receivers on rank
//! 0's machine read from the ring unless `ring` is `None`, which measures the TCP chain that
//! engines on other machines use. The payload is a Llama-shaped set of bf16 decoder-layer tensors of about
//! `mib` MiB; with `fp8`, every projection is quantized with the FP8 block codec on the way
//! (128x128 blocks, f32 scales) and the quantization time is part of each run, as it is part of
//! a real weight sync. The point of the chain is that time stays nearly flat in the number of
//! receivers; on loopback every hop also costs CPU on the same machine, so the flatness seen
//! depends on having about two free cores per receiver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use rayon::prelude::*;

use crate::bucket::{DEFAULT_BUCKET_BYTES, TensorMeta, pack_buckets};
use crate::fp8::{self, Fp8Options, Weights};
use crate::tcp::{TensorRef, TensorSpec, WeightReceiver, WeightSender, WireDtype};

/// Rounds; in each, every receiver count is timed once (after a warm-up of its own) and its
/// copy floor once, so all counts sample the same stretches of a noisy shared machine (a ratio
/// of two counts measured a minute apart says more about the machine than the code). The
/// fastest round of each is reported.
pub const RUNS: usize = 5;
/// Longest a bench sync may take.
pub(crate) const TIMEOUT_SECS: u64 = 600;
/// Most receivers one measurement may use.
pub const MAX_RECEIVERS: usize = 64;
/// Largest payload accepted, in MiB.
pub const MAX_MIB: usize = 16 << 10;
const TIMEOUT: Duration = Duration::from_secs(600);

/// Named bf16 tensors with their shapes: the model as the trainer holds it.
pub(crate) type Model = Vec<(String, Vec<usize>, Vec<bf16>)>;

/// One tensor as sent.
#[derive(Debug, Clone)]
pub(crate) struct WireTensor {
    pub(crate) name: String,
    pub(crate) dtype: WireDtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Vec<u8>,
}

impl WireTensor {
    pub(crate) fn spec(&self) -> TensorSpec {
        TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }
}

/// Broadcasts about `mib` MiB (of bf16 model weights) to each count of in-process receivers in
/// `receivers`, and returns `(metric, value)` pairs per count `n`:
///
/// - `broadcast.receivers_<n>.seconds`: best time of one full sync (with `fp8`, quantizing
///   included), from the first byte sent until every receiver confirmed every bucket;
/// - `broadcast.receivers_<n>.gb_per_s`: model bytes (the bf16 size, also with `fp8`) over
///   that time, so FP8 and BF16 figures compare the same model;
///
/// - `broadcast.receivers_<n>.on_ring`: how many of the `n` read from the shared-memory ring;
/// - `broadcast.receivers_<n>.floor_seconds`: the [`copy_floor`](crate::copy_floor) of `n`
///   receivers, what their own copies of the payload take on this machine with nothing else;
/// - with 1 among the counts, `broadcast.receivers_<n>.vs_1` (time against one receiver's) and
///   `broadcast.receivers_<n>.floor_vs_1` (the floor's growth: the machine's bound for it);
///
/// plus `broadcast.model_bytes` and `broadcast.wire_bytes` (what each receiver reads) once.
/// Every receiver's copy is checked byte for byte against what was sent. Needs a multi-thread
/// tokio runtime (receivers run as tasks).
pub async fn bench_broadcast(
    receivers: &[usize],
    mib: usize,
    fp8: bool,
    ring: Option<usize>,
) -> Result<Vec<(String, f64)>, String> {
    if receivers.is_empty() || receivers.iter().any(|&n| n == 0 || n > MAX_RECEIVERS) {
        return Err(format!(
            "receivers must be a non-empty list of counts between 1 and {MAX_RECEIVERS}, e.g. 1,2,4,8; got {receivers:?}"
        ));
    }
    if mib == 0 || mib > MAX_MIB {
        return Err(format!(
            "mib must be between 1 and {MAX_MIB}, e.g. 512; got {mib}"
        ));
    }
    let model = tokio::task::spawn_blocking(move || model_tensors(mib))
        .await
        .map_err(|e| format!("generating the model failed: {e}"))?;
    let model = Arc::new(model);
    let model_bytes: usize = model.iter().map(|(_, _, v)| v.len() * 2).sum();
    // The reference copy every receiver is checked against, and the buffers each run fills.
    let expected = {
        let m = model.clone();
        tokio::task::spawn_blocking(move || encode(&m, fp8, None))
            .await
            .map_err(|e| format!("encoding failed: {e}"))??
    };
    let wire_bytes: usize = expected.iter().map(|t| t.bytes.len()).sum();
    let metas = expected
        .iter()
        .map(|t| TensorMeta::new(t.name.clone(), t.dtype, t.shape.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let buckets: Vec<Vec<usize>> = {
        let index: std::collections::HashMap<&str, usize> = expected
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        pack_buckets(metas, DEFAULT_BUCKET_BYTES)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|b| b.tensors.iter().map(|t| index[t.name.as_str()]).collect())
            .collect()
    };
    let expected = Arc::new(expected);
    let buckets = Arc::new(buckets);
    let mut work = Some((*expected).clone());
    let mut out = vec![
        ("broadcast.model_bytes".to_string(), model_bytes as f64),
        ("broadcast.wire_bytes".to_string(), wire_bytes as f64),
    ];
    // Best time, receivers on the ring and best floor per count, filled round by round.
    let mut best = vec![(f64::INFINITY, 0usize, f64::INFINITY); receivers.len()];
    let ring_bytes = ring.unwrap_or(crate::tcp::shm::DEFAULT_RING_BYTES);
    for _ in 0..RUNS {
        for (k, &n) in receivers.iter().enumerate() {
            let (secs, on_ring, w) = measure(
                n,
                fp8,
                ring,
                model.clone(),
                expected.clone(),
                buckets.clone(),
                work.take().unwrap_or_default(),
            )
            .await?;
            work = Some(w);
            let floor = tokio::task::spawn_blocking(move || {
                crate::copy_floor::copy_floor(n, wire_bytes, ring_bytes, 1)
            })
            .await
            .map_err(|e| format!("measuring the copy floor failed: {e}"))?;
            let b = &mut best[k];
            *b = (b.0.min(secs), on_ring, b.2.min(floor));
        }
    }
    let mut times = Vec::with_capacity(receivers.len());
    for (&n, &(secs, on_ring, floor)) in receivers.iter().zip(&best) {
        out.push((format!("broadcast.receivers_{n}.seconds"), secs));
        out.push((
            format!("broadcast.receivers_{n}.gb_per_s"),
            model_bytes as f64 / secs / 1e9,
        ));
        out.push((format!("broadcast.receivers_{n}.on_ring"), on_ring as f64));
        out.push((format!("broadcast.receivers_{n}.floor_seconds"), floor));
        times.push((n, secs, floor));
    }
    // Against one receiver, when one was measured: the broadcast's growth and the floor's.
    if let Some(&(_, one, one_floor)) = times.iter().find(|(n, _, _)| *n == 1) {
        for &(n, secs, floor) in times.iter().filter(|(n, _, _)| *n != 1) {
            out.push((format!("broadcast.receivers_{n}.vs_1"), secs / one));
            out.push((
                format!("broadcast.receivers_{n}.floor_vs_1"),
                floor / one_floor,
            ));
        }
    }
    Ok(out)
}

/// One receiver count: a fresh group, one warm-up and one timed sync. Returns its time, how
/// many receivers were on the ring, and the work buffers for reuse.
async fn measure(
    n: usize,
    fp8: bool,
    ring: Option<usize>,
    model: Arc<Model>,
    expected: Arc<Vec<WireTensor>>,
    buckets: Arc<Vec<Vec<usize>>>,
    mut work: Vec<WireTensor>,
) -> Result<(f64, usize, Vec<WireTensor>), String> {
    let mut sender = WeightSender::bind("127.0.0.1:0", n + 1, "bench")
        .await
        .map_err(|e| e.to_string())?;
    sender.set_bucket_timeout(TIMEOUT);
    sender.set_shared_memory(ring).map_err(|e| e.to_string())?;
    let addr = sender.local_addr().map_err(|e| e.to_string())?.to_string();
    let key = sender.secret();
    // A warm-up (connections, first touches of every buffer), then the timed sync.
    let total_runs = 2;
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (addr, key) = (addr.clone(), key.clone());
        let (expected, buckets) = (expected.clone(), buckets.clone());
        tasks.push(tokio::spawn(async move {
            let at = (addr.as_str(), key.as_str());
            receive(at, i as u32 + 1, &expected, &buckets, total_runs, None).await
        }));
    }
    sender
        .accept_all(Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let on_ring = sender.shared_memory_receivers().len();
    let mut timed = f64::INFINITY;
    for run in 0..total_runs {
        let start = Instant::now();
        if fp8 {
            let (m, w) = (model.clone(), std::mem::take(&mut work));
            work = tokio::task::spawn_blocking(move || encode(&m, true, Some(w)))
                .await
                .map_err(|e| format!("quantizing failed: {e}"))??;
        }
        for b in buckets.iter() {
            let refs: Vec<TensorRef<'_>> = b
                .iter()
                .map(|&i| TensorRef {
                    name: &work[i].name,
                    dtype: work[i].dtype,
                    shape: &work[i].shape,
                    bytes: &work[i].bytes,
                })
                .collect();
            sender
                .send_bucket(&refs)
                .await
                .map_err(|e| format!("{n} receivers: {e}"))?;
        }
        if run + 1 == total_runs {
            timed = start.elapsed().as_secs_f64();
        }
    }
    for t in tasks {
        t.await.map_err(|e| format!("receiver task: {e}"))??;
    }
    sender.close().await.map_err(|e| e.to_string())?;
    Ok((timed, on_ring, work))
}

/// A receiver: joins rank 0 at `(address, group secret)`, reads `runs` syncs (handing each
/// bucket back, as an engine does once it applied it, which also keeps delta bases), and
/// checks the last one byte for byte.
pub(crate) async fn receive(
    (addr, key): (&str, &str),
    rank: u32,
    expected: &[WireTensor],
    buckets: &[Vec<usize>],
    runs: usize,
    link_gbps: Option<f64>,
) -> Result<(), String> {
    let mut rx = WeightReceiver::connect(addr, "bench", key, rank, 1, Duration::from_secs(60))
        .await
        .map_err(|e| format!("rank {rank}: {e}"))?;
    if let Some(g) = link_gbps {
        rx.pace_link(g).map_err(|e| e.to_string())?;
    }
    let specs: Vec<Vec<TensorSpec>> = buckets
        .iter()
        .map(|b| b.iter().map(|&i| expected[i].spec()).collect())
        .collect();
    for run in 0..runs {
        for (b, s) in buckets.iter().zip(&specs) {
            let got = rx
                .recv_bucket(s, TIMEOUT)
                .await
                .map_err(|e| format!("rank {rank}: {e}"))?;
            if run + 1 == runs {
                for (t, &i) in got.iter().zip(b) {
                    if t.bytes != expected[i].bytes {
                        return Err(format!(
                            "rank {rank}: tensor {} differs from what was sent",
                            t.name
                        ));
                    }
                }
            }
            // As an engine does once it has applied a bucket.
            rx.recycle(got);
        }
    }
    Ok(())
}

/// The wire tensors for `model`: bf16 as is, or with `fp8` every projection quantized
/// (128x128 blocks, f32 scales) followed by its scale. `reuse` holds buffers of a previous call
/// to fill in place (the steady state of repeated syncs).
pub(crate) fn encode(
    model: &[(String, Vec<usize>, Vec<bf16>)],
    fp8: bool,
    reuse: Option<Vec<WireTensor>>,
) -> Result<Vec<WireTensor>, String> {
    let opts = Fp8Options::default();
    let mut out = reuse.unwrap_or_default();
    let fresh = out.is_empty();
    let mut k = 0;
    for (name, shape, data) in model {
        if fp8 && fp8::should_quantize(name, shape) {
            let (rows, cols) = (shape[0], shape[1]);
            let scale_count = opts.granularity.scale_count(rows, cols);
            if fresh {
                out.push(WireTensor {
                    name: name.clone(),
                    dtype: WireDtype::F8E4M3,
                    shape: shape.clone(),
                    bytes: vec![0; rows * cols],
                });
                out.push(WireTensor {
                    name: fp8::scale_name(name, opts.granularity).map_err(|e| e.to_string())?,
                    dtype: WireDtype::F32,
                    shape: opts.granularity.scale_shape(rows, cols),
                    bytes: vec![0; scale_count * 4],
                });
            }
            let mut scales = vec![0f32; scale_count];
            let (q, s) = out[k..k + 2].split_at_mut(1);
            fp8::quantize_into(
                name,
                rows,
                cols,
                Weights::Bf16(data),
                &opts,
                &mut q[0].bytes,
                &mut scales,
            )
            .map_err(|e| e.to_string())?;
            for (dst, v) in s[0].bytes.chunks_exact_mut(4).zip(&scales) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
            k += 2;
        } else {
            if fresh {
                out.push(WireTensor {
                    name: name.clone(),
                    dtype: WireDtype::Bf16,
                    shape: shape.clone(),
                    bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                });
            }
            k += 1;
        }
    }
    Ok(out)
}

/// Decoder layers of a Llama-shaped model (GQA 4:1, MLP 2.75x) adding up to about `mib` MiB of
/// bf16: width 1024 for large payloads, 256 for small ones so a small run stays small.
pub(crate) fn model_tensors(mib: usize) -> Model {
    let h = if mib >= 64 { 1024 } else { 256 };
    let (kv, inter) = (h / 4, h * 11 / 4);
    let layer_shapes = [
        ("input_layernorm.weight", vec![h]),
        ("self_attn.q_proj.weight", vec![h, h]),
        ("self_attn.k_proj.weight", vec![kv, h]),
        ("self_attn.v_proj.weight", vec![kv, h]),
        ("self_attn.o_proj.weight", vec![h, h]),
        ("post_attention_layernorm.weight", vec![h]),
        ("mlp.gate_proj.weight", vec![inter, h]),
        ("mlp.up_proj.weight", vec![inter, h]),
        ("mlp.down_proj.weight", vec![h, inter]),
    ];
    let layer_bytes: usize = layer_shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * 2)
        .sum();
    let layers = ((mib << 20) as f64 / layer_bytes as f64).round().max(1.0) as usize;
    let mut specs = Vec::new();
    for l in 0..layers {
        for (n, s) in &layer_shapes {
            specs.push((format!("model.layers.{l}.{n}"), s.clone()));
        }
    }
    specs
        .into_par_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let len = shape.iter().product();
            (name, shape, weights(i as u64, len))
        })
        .collect()
}

/// Roughly normal values of scale 0.02, deterministic per tensor.
fn weights(seed: u64, len: usize) -> Vec<bf16> {
    let mut state = 0x853C_49E6_748F_EA9B_u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let s: u64 = (0..4).map(|k| (state >> (16 * k)) & 0xFFFF).sum();
            bf16::from_f32((s as f32 / 131_070.0 - 1.0) * 0.04)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bench_reports_every_count_and_checks_bytes() {
        let r = tokio::time::timeout(Duration::from_secs(120), async {
            use crate::tcp::shm::DEFAULT_RING_BYTES;
            for (fp8, ring) in [
                (false, None),
                (true, None),
                (false, Some(DEFAULT_RING_BYTES)),
            ] {
                let out = bench_broadcast(&[1, 3], 2, fp8, ring).await.unwrap();
                let get = |k: &str| out.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
                for n in [1, 3] {
                    let s = get(&format!("broadcast.receivers_{n}.seconds")).unwrap();
                    let g = get(&format!("broadcast.receivers_{n}.gb_per_s")).unwrap();
                    assert!(s > 0.0 && g > 0.0);
                    let on_ring = get(&format!("broadcast.receivers_{n}.on_ring")).unwrap();
                    let want = if ring.is_some() && cfg!(target_os = "linux") {
                        n
                    } else {
                        0
                    };
                    assert_eq!(on_ring, want as f64, "{n} receivers, ring {ring:?}");
                    let floor = get(&format!("broadcast.receivers_{n}.floor_seconds")).unwrap();
                    assert!(floor > 0.0 && floor.is_finite());
                }
                for k in ["vs_1", "floor_vs_1"] {
                    assert!(get(&format!("broadcast.receivers_3.{k}")).unwrap() > 0.0);
                    assert!(get(&format!("broadcast.receivers_1.{k}")).is_none());
                }
                let (model, wire) = (
                    get("broadcast.model_bytes").unwrap(),
                    get("broadcast.wire_bytes").unwrap(),
                );
                if fp8 {
                    assert!(wire < 0.6 * model, "fp8 wire {wire} vs model {model}");
                } else {
                    assert_eq!(wire, model);
                }
            }
            assert!(bench_broadcast(&[], 2, false, None).await.is_err());
            assert!(bench_broadcast(&[0], 2, false, None).await.is_err());
            assert!(bench_broadcast(&[1], 0, false, None).await.is_err());
            let tiny = bench_broadcast(&[1], 2, false, Some(100))
                .await
                .unwrap_err();
            assert!(tiny.contains("ring"), "{tiny}");
        })
        .await;
        r.expect("bench test timed out");
    }
}
