//! An engine applying a delta as soon as its frame is in, on the CPU pool (rayon's, which
//! the apply splits its blocks over anyway), while the rest of the bucket is still being read
//! and forwarded: the applies then overlap the link instead of following it.

use tokio::sync::oneshot;

use crate::delta::SharedReceiverBases;
use crate::delta::codec;

/// A delta's result: the tensor's new bytes and their checksum, or why it could not be had.
pub(crate) type Applied = Result<(Vec<u8>, u64), String>;

/// A delta started when its frame completed.
#[derive(Debug)]
pub(crate) enum Work {
    /// Being applied to the base it names.
    Running(oneshot::Receiver<Applied>),
    /// Refused at once (this engine does not hold that base).
    Done(Applied),
}

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
    let Some((mut buf, sum)) = base else {
        return Work::Done(Err(
            "this engine does not hold the base it applies to".into()
        ));
    };
    let (tx, rx) = oneshot::channel();
    rayon::spawn(move || {
        let applied = match codec::apply(&mut buf, &delta, elem, sum) {
            Ok(sum) => Ok((buf, sum)),
            Err(e) => Err(format!("malformed delta: {e}")),
        };
        let _ = tx.send(applied);
    });
    Work::Running(rx)
}

/// Waits for a delta's result.
pub(crate) async fn finish(work: Work) -> Applied {
    match work {
        Work::Running(r) => r.await.unwrap_or_else(|_| Err("the apply panicked".into())),
        Work::Done(a) => a,
    }
}
