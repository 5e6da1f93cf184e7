//! Delta updates over real sockets and the real ring: every receiver ends each step with
//! exactly the bytes a full update sends (BF16, and FP8 quantized first), across steps, for a
//! receiver that missed a step, a restarted one, an engine that kept a buffer (and wrote to it), and a delta
//! corrupted on the way.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use half::bf16;

use super::*;
use crate::delta::{DeltaStats, ReceiverBases, SenderBases, SharedReceiverBases};
use crate::fp8::{self, Fp8Options, Weights};

const T: Duration = Duration::from_secs(20);

/// One wire tensor of the model.
#[derive(Clone)]
struct Wt {
    name: String,
    dtype: WireDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// A trainer's master weights: a BF16 vector and an FP8-quantized projection.
struct Trainer {
    norm: Vec<f32>,
    proj: Vec<f32>,
    seed: u64,
}

const ROWS: usize = 256;
const COLS: usize = 384;

impl Trainer {
    fn new() -> Self {
        let mut t = Trainer {
            norm: Vec::new(),
            proj: Vec::new(),
            seed: 7,
        };
        t.norm = (0..70_000).map(|_| t.rand() * 0.1).collect();
        t.proj = (0..ROWS * COLS).map(|_| t.rand() * 0.05).collect();
        t
    }

    fn rand(&mut self) -> f32 {
        self.seed = self
            .seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// A small optimizer step: every value moves by ~1e-3 relative, so only some BF16 and FP8
    /// values cross a rounding boundary.
    fn step(&mut self) {
        for i in 0..self.norm.len() {
            let r = self.rand();
            self.norm[i] *= 1.0 + 2e-3 * r;
        }
        for i in 0..self.proj.len() {
            let r = self.rand();
            self.proj[i] *= 1.0 + 2e-3 * r;
        }
    }

    /// The wire tensors a full update sends.
    fn wire(&self) -> Vec<Wt> {
        let norm: Vec<u8> = self
            .norm
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        let opts = Fp8Options::default();
        let q = fp8::quantize("proj.weight", ROWS, COLS, Weights::F32(&self.proj), &opts).unwrap();
        let scale_name = fp8::scale_name("proj.weight", opts.granularity).unwrap();
        vec![
            Wt {
                name: "norm.weight".into(),
                dtype: WireDtype::Bf16,
                shape: vec![self.norm.len()],
                bytes: norm,
            },
            Wt {
                name: "proj.weight".into(),
                dtype: WireDtype::F8E4M3,
                shape: vec![ROWS, COLS],
                bytes: q.data,
            },
            Wt {
                name: scale_name,
                dtype: WireDtype::F32,
                shape: opts.granularity.scale_shape(ROWS, COLS),
                bytes: q.scales.to_le_bytes(),
            },
        ]
    }
}

/// Builds a group of `bases.len()` receivers (ranks 1..), each keeping the given bases.
async fn group(
    bases: &[SharedReceiverBases],
    sender_bases: &Arc<Mutex<SenderBases>>,
    ring: bool,
) -> (WeightSender, Vec<WeightReceiver>) {
    let mut sender = WeightSender::bind("127.0.0.1:0", bases.len() + 1, "d")
        .await
        .unwrap();
    sender
        .set_shared_memory(ring.then_some(shm::DEFAULT_RING_BYTES))
        .unwrap();
    sender.set_delta(Some(sender_bases.clone()));
    let addr = sender.local_addr().unwrap().to_string();
    let key = sender.secret();
    let joins: Vec<_> = bases
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (addr, key, b) = (addr.clone(), key.clone(), b.clone());
            tokio::spawn(async move {
                WeightReceiver::connect_with_bases(&addr, "d", &key, i as u32 + 1, 1, T, b).await
            })
        })
        .collect();
    sender.accept_all(T).await.unwrap();
    let mut rxs = Vec::new();
    for j in joins {
        rxs.push(j.await.unwrap().unwrap());
    }
    (sender, rxs)
}

/// One sync of `model`: every receiver must end with exactly its bytes. `scribble` makes the
/// first receiver's engine take the first tensor's buffer for itself and write to it;
/// `shared` hands the sender buffers it may keep (`send_bucket_shared`: streamed down the
/// chain while it is diffed), else borrowed ones (`send_bucket`: diffed, then sent).
async fn sync(
    sender: &mut WeightSender,
    rxs: Vec<WeightReceiver>,
    model: &[Wt],
    scribble: bool,
    shared: bool,
) -> (Vec<WeightReceiver>, DeltaStats) {
    let specs: Vec<TensorSpec> = model
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let tasks: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            let specs = specs.clone();
            tokio::spawn(async move {
                let got = rx.recv_bucket(&specs, T).await;
                (rx, got)
            })
        })
        .collect();
    let refs: Vec<TensorRef<'_>> = model
        .iter()
        .map(|t| TensorRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &t.bytes,
        })
        .collect();
    if shared {
        let owners: Vec<bytes::Bytes> = model
            .iter()
            .map(|t| bytes::Bytes::copy_from_slice(&t.bytes))
            .collect();
        let refs: Vec<SharedTensorRef<'_>> = refs
            .iter()
            .zip(&owners)
            .map(|(r, b)| SharedTensorRef {
                name: r.name,
                dtype: r.dtype,
                shape: r.shape,
                bytes: b,
            })
            .collect();
        sender.send_bucket_shared(&refs).await.unwrap();
    } else {
        sender.send_bucket(&refs).await.unwrap();
    }
    let mut out = Vec::new();
    for (k, task) in tasks.into_iter().enumerate() {
        let (mut rx, got) = task.await.unwrap();
        let mut got = got.unwrap();
        for (g, want) in got.iter().zip(model) {
            assert_eq!(g.name, want.name);
            assert!(g.bytes == want.bytes, "receiver {k}: {} differs", g.name);
        }
        if scribble && k == 0 {
            // Its bytes are read-only; to write, the engine must take the buffer for good.
            let mut own = got.remove(0).bytes.into_vec();
            own[100] ^= 1;
        }
        rx.recycle(got);
        out.push(rx);
    }
    (out, sender.take_stats())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_are_bit_exact_across_steps_on_the_chain_and_the_ring() {
    tokio::time::timeout(Duration::from_secs(60), async {
        for (ring, shared) in [(false, false), (false, true), (true, true)] {
            let sb = Arc::new(Mutex::new(SenderBases::new(false)));
            let bases = [ReceiverBases::shared(), ReceiverBases::shared()];
            let (mut sender, mut rxs) = group(&bases, &sb, ring).await;
            let mut trainer = Trainer::new();
            let mut stats = Vec::new();
            for _ in 0..4 {
                let (r, s) = sync(&mut sender, rxs, &trainer.wire(), false, shared).await;
                rxs = r;
                stats.push(s);
                trainer.step();
            }
            // The first sync is whole (nobody holds anything); in every later one the BF16
            // tensor and the FP8 weight go as deltas (the 6 block scales mostly all change, so
            // they go whole), much smaller than the model.
            assert_eq!(stats[0].whole_tensors, 3);
            assert_eq!(stats[0].delta_tensors, 0);
            for s in &stats[1..] {
                assert!(s.delta_tensors >= 2, "{s:?}");
                assert_eq!(s.delta_tensors + s.whole_tensors, 3);
                assert_eq!(s.repaired_tensors, 0);
                assert!(s.sent_bytes * 3 < s.full_bytes, "{s:?}");
                let f = s.changed_fraction().unwrap();
                assert!(f > 0.0 && f < 0.5, "changed fraction {f}");
            }
            let held = bases[0].lock().unwrap().bytes();
            assert_eq!(held, sb.lock().unwrap().bytes(), "receivers keep one copy");
        }
    })
    .await
    .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_missed_a_step_or_restarted_gets_tensors_whole() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sb = Arc::new(Mutex::new(SenderBases::new(false)));
        let (a, b) = (ReceiverBases::shared(), ReceiverBases::shared());
        let mut trainer = Trainer::new();
        // Step 1: both. Step 2: only A (B was down).
        let (mut s1, rxs) = group(&[a.clone(), b.clone()], &sb, false).await;
        sync(&mut s1, rxs, &trainer.wire(), false, true).await;
        s1.close().await.unwrap();
        trainer.step();
        let (mut s2, rxs) = group(std::slice::from_ref(&a), &sb, false).await;
        let (rxs, st) = sync(&mut s2, rxs, &trainer.wire(), false, true).await;
        assert!(st.delta_tensors >= 2, "A held the bases: {st:?}");
        drop(rxs);
        s2.close().await.unwrap();
        // Step 3: B is back with its old bases: its digest differs, so everything goes whole
        // (both still end exact); step 4 in the same group is a delta again.
        trainer.step();
        let (mut s3, rxs) = group(&[a.clone(), b.clone()], &sb, false).await;
        let (rxs, st) = sync(&mut s3, rxs, &trainer.wire(), false, true).await;
        assert_eq!((st.whole_tensors, st.delta_tensors), (3, 0), "{st:?}");
        trainer.step();
        let (rxs, st) = sync(&mut s3, rxs, &trainer.wire(), false, true).await;
        assert!(st.delta_tensors >= 2, "{st:?}");
        drop(rxs);
        s3.close().await.unwrap();
        // A restarted engine holds nothing: whole again, then deltas.
        trainer.step();
        let (mut s4, rxs) = group(&[a.clone(), ReceiverBases::shared()], &sb, true).await;
        let (rxs, st) = sync(&mut s4, rxs, &trainer.wire(), false, true).await;
        assert_eq!(st.whole_tensors, 3, "{st:?}");
        trainer.step();
        let (_rxs, st) = sync(&mut s4, rxs, &trainer.wire(), false, true).await;
        assert!(st.delta_tensors >= 2, "{st:?}");
    })
    .await
    .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_delta_or_base_is_resent_whole_never_applied() {
    tokio::time::timeout(Duration::from_secs(60), async {
        for (ring, shared) in [(false, false), (false, true), (true, true)] {
            let sb = Arc::new(Mutex::new(SenderBases::new(true)));
            let bases = [ReceiverBases::shared(), ReceiverBases::shared()];
            let (mut sender, rxs) = group(&bases, &sb, ring).await;
            let mut trainer = Trainer::new();
            // The first receiver's engine keeps (and scribbles on) a buffer instead of handing
            // it back: that receiver no longer holds the base, and asks for the tensor whole.
            let (rxs, _) = sync(&mut sender, rxs, &trainer.wire(), true, shared).await;
            trainer.step();
            let (rxs, st) = sync(&mut sender, rxs, &trainer.wire(), false, shared).await;
            assert_eq!(
                st.repaired_tensors, 1,
                "the base kept by the engine: {st:?}"
            );
            // A byte of a delta flipped on the way: every receiver asks for it whole.
            trainer.step();
            sender.corrupt_next_delta = true;
            let (rxs, st) = sync(&mut sender, rxs, &trainer.wire(), false, shared).await;
            assert_eq!(st.repaired_tensors, 1, "the corrupted delta: {st:?}");
            // And the next step is a clean delta again.
            trainer.step();
            let (_rxs, st) = sync(&mut sender, rxs, &trainer.wire(), false, shared).await;
            assert!(st.delta_tensors >= 2 && st.repaired_tensors == 0, "{st:?}");
        }
    })
    .await
    .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_delta_bases_are_dropped_and_nothing_is_kept() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sb = Arc::new(Mutex::new(SenderBases::new(false)));
        let bases = [ReceiverBases::shared()];
        let (mut sender, rxs) = group(&bases, &sb, false).await;
        let trainer = Trainer::new();
        let (rxs, _) = sync(&mut sender, rxs, &trainer.wire(), false, true).await;
        assert_eq!(bases[0].lock().unwrap().len(), 3);
        sender.set_delta(None);
        let (_rxs, st) = sync(&mut sender, rxs, &trainer.wire(), false, true).await;
        assert_eq!(
            (st.delta_tensors, st.whole_tensors, st.compared_elems),
            (0, 0, 0)
        );
        assert!(st.sent_bytes > st.full_bytes && st.full_bytes > 0, "{st:?}");
        assert_eq!(
            bases[0].lock().unwrap().len(),
            0,
            "delta-off frames drop the bases"
        );
    })
    .await
    .expect("timed out");
}

/// A delta-on bucket in buffers the sender keeps is streamed: an engine starts applying the
/// first tensor's delta before rank 0 has diffed the second (the planner waits for that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_bucket_is_applied_while_it_is_still_being_diffed() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sb = Arc::new(Mutex::new(SenderBases::new(false)));
        let bases = [ReceiverBases::shared()];
        let (mut sender, rxs) = group(&bases, &sb, false).await;
        let mut trainer = Trainer::new();
        let (rxs, _) = sync(&mut sender, rxs, &trainer.wire(), false, true).await;
        assert_eq!(bases[0].lock().unwrap().len(), 3);
        trainer.step();
        let (gate, gated) = std::sync::mpsc::channel();
        sender.plan_gate = Some(gated);
        let held = bases[0].clone();
        let opener = tokio::spawn(async move {
            // The first tensor's base leaves the engine's bases when its delta starts applying.
            let deadline = tokio::time::Instant::now() + T;
            while held.lock().unwrap().len() == 3 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the engine did not start on the first delta before the second was diffed"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            for _ in 0..2 {
                let _ = gate.send(());
            }
        });
        let (_rxs, st) = sync(&mut sender, rxs, &trainer.wire(), false, true).await;
        opener.await.unwrap();
        assert!(st.delta_tensors >= 2, "{st:?}");
    })
    .await
    .expect("timed out");
}
