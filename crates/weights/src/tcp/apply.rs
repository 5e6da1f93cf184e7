//! An engine applying a delta as soon as its frame is in, on the CPU pool (rayon's, which
//! the apply splits its blocks over anyway), while the rest of the bucket is still being read
//! and forwarded: the applies then overlap the link instead of following it.

use tokio::sync::oneshot;

use crate::delta::codec;
use crate::delta::{ReceiverBases, SharedReceiverBases};

/// A delta's result: the tensor's new bytes and their checksum, or why it could not be had.
pub(crate) type Applied = Result<(Vec<u8>, u64), String>;

/// Where a delta read in full stands.
#[derive(Debug)]
pub(crate) enum Work {
    /// Its block stream, to apply once the bucket is in (a decoder given no bases).
    Later(Vec<u8>),
    /// Being applied to the base taken when its frame completed.
    Running(oneshot::Receiver<Applied>),
    /// Applied, or refused.
    Done(Applied),
}

const NO_BASE: &str = "this engine does not hold the base it applies to";

/// Takes the base of `name` (held under `tag`, `len` bytes of `elem`-byte elements) and
/// starts applying `delta` to it on the CPU pool.
pub(crate) fn start(
    bases: &SharedReceiverBases,
    name: &str,
    tag: u64,
    len: usize,
    elem: usize,
    delta: Vec<u8>,
) -> Work {
    let base = bases.lock().ok().and_then(|mut b| b.take(name, tag, len));
    match base {
        None => Work::Done(Err(NO_BASE.into())),
        Some((buf, sum)) => {
            let (tx, rx) = oneshot::channel();
            rayon::spawn(move || {
                let _ = tx.send(patch(buf, &delta, elem, sum));
            });
            Work::Running(rx)
        }
    }
}

/// Applies `delta` now to the base of `name` taken from `bases`.
pub(crate) fn now(
    bases: &mut ReceiverBases,
    name: &str,
    tag: u64,
    len: usize,
    elem: usize,
    delta: &[u8],
) -> Applied {
    match bases.take(name, tag, len) {
        None => Err(NO_BASE.into()),
        Some((buf, sum)) => patch(buf, delta, elem, sum),
    }
}

/// Waits for a running apply.
pub(crate) async fn finish(work: Work) -> Work {
    match work {
        Work::Running(r) => {
            Work::Done(r.await.unwrap_or_else(|_| Err("the apply panicked".into())))
        }
        other => other,
    }
}

fn patch(mut buf: Vec<u8>, delta: &[u8], elem: usize, base_sum: u64) -> Applied {
    match codec::apply(&mut buf, delta, elem, base_sum) {
        Ok(sum) => Ok((buf, sum)),
        Err(e) => Err(format!("malformed delta: {e}")),
    }
}
