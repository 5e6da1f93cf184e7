//! Rank 0 diffing a delta-on bucket while it sends it: each tensor's frame goes down the chain
//! as soon as it is planned, so the link (and the engines' applies) work while the next
//! tensors are diffed, instead of after the whole bucket's diff.
//!
//! The diff of a bucket reads both versions of it (about half a full send's time on one
//! machine); over a link slower than memory, planned then sent one after another, the diff,
//! the send and the apply add up, and pipelined the slowest of them bounds the sync.

use bytes::Bytes;
use tokio::sync::mpsc;

use super::frame::{encode_header, encode_header_with};
use super::{FRAME_DELTA, FRAME_WHOLE_TAGGED, TcpError, TensorRef, WireDtype};
use crate::delta::DeltaStats;
use crate::delta::bases::{Plan, SenderBases};

/// What follows a frame header on the wire.
pub(super) enum Body {
    /// The caller's tensor bytes, as they lie.
    Tensor,
    /// A delta's block stream.
    Delta(Vec<u8>),
}

/// Decides how tensor `t` goes (see [`SenderBases::plan`]), counts it in `stats` and, when
/// it goes whole and tagged, names it in `whole` (every engine holds it once committed);
/// returns its frame header and what follows it.
pub(super) fn plan_one(
    bases: &mut SenderBases,
    t: &TensorRef<'_>,
    shared: Option<&Bytes>,
    eligible: bool,
    stats: &mut DeltaStats,
    whole: &mut Vec<String>,
) -> Result<(Vec<u8>, Body), TcpError> {
    let elem = t.dtype.elem_size();
    match bases.plan(t.name, t.shape, elem, t.bytes, shared, eligible) {
        Plan::Whole {
            tag,
            compared,
            changed,
        } => {
            stats.compared_elems += compared;
            stats.changed_elems += changed;
            stats.whole_tensors += 1;
            whole.push(t.name.to_string());
            Ok((
                encode_header_with(t, FRAME_WHOLE_TAGGED, &[tag])?,
                Body::Tensor,
            ))
        }
        Plan::Plain { compared, changed } => {
            stats.compared_elems += compared;
            stats.changed_elems += changed;
            stats.whole_tensors += 1;
            Ok((encode_header(t)?, Body::Tensor))
        }
        Plan::Delta {
            base_tag,
            result,
            bytes,
            changed,
        } => {
            stats.delta_tensors += 1;
            stats.compared_elems += (t.bytes.len() / elem) as u64;
            stats.changed_elems += changed;
            let extra = [base_tag, result, bytes.len() as u64];
            Ok((
                encode_header_with(t, FRAME_DELTA, &extra)?,
                Body::Delta(bytes),
            ))
        }
    }
}

/// A tensor the planner owns (it runs on a thread of its own): the caller's buffer, shared.
pub(super) struct OwnedRef {
    pub(super) name: String,
    pub(super) dtype: WireDtype,
    pub(super) shape: Vec<usize>,
    pub(super) bytes: Bytes,
    /// Whether every engine holds this sender's base of it.
    pub(super) eligible: bool,
}

/// One piece of the streamed bucket: a tensor's frame, or the end frame.
pub(super) struct Planned {
    pub(super) header: Vec<u8>,
    /// What follows the header; none after the end frame (the bucket was planned in full).
    pub(super) body: Option<Bytes>,
}

/// Where the writer takes a bucket's bytes from.
pub(super) enum Source<'a> {
    /// Pieces made up front, written one after another.
    Pieces(&'a [&'a [u8]]),
    /// Frames as the planner makes them; the stream ends with the end frame, or early when
    /// planning failed.
    Stream(mpsc::UnboundedReceiver<Planned>),
}

/// What the planner did: the statistics of the frames it planned and the tensors that went
/// whole and tagged; or why it stopped.
pub(super) struct Planning {
    pub(super) stats: DeltaStats,
    pub(super) whole: Vec<String>,
    pub(super) failed: Option<TcpError>,
}

/// Test hooks of a bucket's planning (either path): flip a byte of the first delta; wait on
/// `gate` before planning each tensor after the first. Empty outside tests.
#[derive(Default)]
pub(super) struct Hooks {
    corrupt: bool,
    gate: Option<std::sync::mpsc::Receiver<()>>,
}

impl Hooks {
    /// Before planning tensor `i`.
    pub(super) fn before(&self, i: usize) {
        if i > 0
            && let Some(g) = &self.gate
        {
            let _ = g.recv();
        }
    }

    /// On a delta just planned.
    pub(super) fn delta(&mut self, d: &mut [u8]) {
        if std::mem::take(&mut self.corrupt) && !d.is_empty() {
            d[d.len() / 2] ^= 0x5A;
        }
    }
}

/// Plans `tensors` in order, sending each frame to `out` as soon as it is planned, then the
/// end frame `end`. Blocking (the diff): run it on a thread of its own. Stops early when the
/// writer is gone (the bucket failed).
pub(super) fn plan_streamed(
    bases: &std::sync::Mutex<SenderBases>,
    tensors: Vec<OwnedRef>,
    end: Vec<u8>,
    mut hooks: Hooks,
    out: mpsc::UnboundedSender<Planned>,
) -> Planning {
    let mut p = Planning {
        stats: DeltaStats::default(),
        whole: Vec::new(),
        failed: None,
    };
    let Ok(mut b) = bases.lock() else {
        p.failed = Some(TcpError::InvalidArgument("delta bases poisoned".into()));
        return p;
    };
    for (i, t) in tensors.iter().enumerate() {
        hooks.before(i);
        let r = TensorRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &t.bytes,
        };
        let shared = Some(&t.bytes);
        let (header, body) =
            match plan_one(&mut b, &r, shared, t.eligible, &mut p.stats, &mut p.whole) {
                Ok(f) => f,
                Err(e) => {
                    p.failed = Some(e);
                    return p;
                }
            };
        let body = match body {
            Body::Tensor => t.bytes.clone(),
            Body::Delta(mut d) => {
                hooks.delta(&mut d);
                Bytes::from(d)
            }
        };
        p.stats.sent_bytes += (header.len() + body.len()) as u64;
        let piece = Planned {
            header,
            body: Some(body),
        };
        if out.send(piece).is_err() {
            return p;
        }
    }
    p.stats.sent_bytes += end.len() as u64;
    let _ = out.send(Planned {
        header: end,
        body: None,
    });
    p
}

/// A channel for a streamed bucket. Unbounded: the planner runs as far ahead of the link as
/// it can, so the writer does not wait for the planner's thread to be scheduled again at each
/// frame (an FP8 sync whose tensors all went whole, to 1 engine, took a median 1.08x a full
/// one over six runs with 8 frames of room, 0.93-0.96x over two unbounded). What it holds is
/// at most the bucket's deltas (tensors that go whole are the caller's buffers, shared), as
/// when a bucket is diffed before it is sent.
pub(super) fn channel() -> (
    mpsc::UnboundedSender<Planned>,
    mpsc::UnboundedReceiver<Planned>,
) {
    mpsc::unbounded_channel()
}

impl super::WeightSender {
    /// Sends a delta-on bucket of tensors in buffers the sender may keep (`owners`), diffing
    /// on a thread of its own while the frames planned so far go down the chain; then the
    /// repair any engine asks for, then the commit.
    pub(super) async fn send_streamed(
        &mut self,
        tensors: &[TensorRef<'_>],
        owners: &[&Bytes],
        bases: &std::sync::Arc<std::sync::Mutex<SenderBases>>,
        end: Vec<u8>,
        deadline: tokio::time::Instant,
        mut stats: DeltaStats,
    ) -> Result<(), TcpError> {
        let digest = bases
            .lock()
            .map_err(|_| TcpError::InvalidArgument("delta bases poisoned".into()))?
            .digest();
        let synced = self.synced_with(digest);
        let owned = tensors
            .iter()
            .zip(owners)
            .map(|(t, &b)| OwnedRef {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                bytes: b.clone(),
                eligible: synced || self.whole_since_join.contains(t.name),
            })
            .collect();
        let hooks = self.take_hooks();
        let (tx, rx) = channel();
        let shared = bases.clone();
        let planner =
            tokio::task::spawn_blocking(move || plan_streamed(&shared, owned, end, hooks, tx));
        // The writer ends once the planner sent the end frame, or it failed (dropping the
        // stream stops the planner), so the planner is done soon after either way.
        let sent = self.transmit(Source::Stream(rx), deadline).await;
        let planning = planner
            .await
            .map_err(|e| TcpError::Protocol(format!("delta planner: {e}")));
        let done = match (sent, planning) {
            (
                _,
                Ok(Planning {
                    failed: Some(e), ..
                }),
            )
            | (_, Err(e))
            | (Err(e), _) => Err(e),
            (Ok(outcomes), Ok(p)) => {
                stats.add(&p.stats);
                self.repair_then_commit(tensors, &outcomes, deadline, &mut stats)
                    .await
                    .map(|()| p.whole)
            }
        };
        self.settle(tensors, bases, done, stats)
    }

    /// Ends a delta-on bucket: once committed, what it sent whole and tagged is held by every
    /// engine, and its statistics count; if it failed, engines may hold either version of its
    /// tensors, so no delta is taken against them.
    pub(super) fn settle(
        &mut self,
        tensors: &[TensorRef<'_>],
        bases: &std::sync::Mutex<SenderBases>,
        done: Result<Vec<String>, TcpError>,
        stats: DeltaStats,
    ) -> Result<(), TcpError> {
        match done {
            Ok(whole) => {
                self.whole_since_join.extend(whole);
                self.stats.add(&stats);
                Ok(())
            }
            Err(e) => {
                if let Ok(mut b) = bases.lock() {
                    for t in tensors {
                        b.forget(t.name);
                    }
                }
                Err(e)
            }
        }
    }

    /// The test hooks set for the next bucket.
    pub(super) fn take_hooks(&mut self) -> Hooks {
        #[cfg(test)]
        return Hooks {
            corrupt: std::mem::take(&mut self.corrupt_next_delta),
            gate: self.plan_gate.take(),
        };
        #[cfg(not(test))]
        Hooks::default()
    }

    /// Whether every engine joined holding exactly the sender's bases (summed in `digest`),
    /// decided at the group's first delta-on bucket.
    pub(super) fn synced_with(&mut self, digest: u64) -> bool {
        *self
            .synced
            .get_or_insert_with(|| self.peers.iter().all(|p| p.digest == digest))
    }
}
