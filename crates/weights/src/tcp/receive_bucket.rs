//! An engine reading one bucket: the frames (each delta starts applying to the base it names
//! as its frame completes, `apply.rs`), then the deltas' results checked, the confirmation
//! (naming deltas it could not apply), the repair rank 0 sends then, and the commit; and the
//! pace at which a benchmark may have it read its link.

use tokio::time::Instant;

use super::apply;
use super::assemble::Frames;
use super::control::{FromEngine, ToEngine, write_from_engine};
use super::pace::Pace;
use super::receiver::{Failure, read_control};
use super::{OwnedTensor, TcpError, TensorBytes, TensorSpec, WeightReceiver};

impl WeightReceiver {
    /// Reads a bucket, applies its deltas, confirms it (naming deltas that could not be
    /// applied), reads the repair rank 0 then sends if any engine named one, and waits for
    /// the commit.
    pub(super) async fn receive(
        &mut self,
        expected: &[TensorSpec],
        deadline: Instant,
    ) -> Result<Vec<OwnedTensor>, Failure> {
        let (mut tensors, frames) = self.transfer(expected, deadline).await?;
        let mut need = self.resolve(&mut tensors, frames).await;
        let mut repaired = false;
        loop {
            let ack = if need.is_empty() {
                FromEngine::Ack
            } else {
                FromEngine::AckNeed(need.clone())
            };
            write_from_engine(&mut self.control, &ack)
                .await
                .map_err(|e| Failure::Lost(e.to_string()))?;
            match read_control(&mut self.control, deadline, "the bucket verdict").await {
                Ok(ToEngine::Commit) if need.is_empty() => return Ok(tensors),
                Ok(ToEngine::Commit) => {
                    return Err(Failure::Mine(
                        "rank 0 committed a bucket whose deltas this engine could not apply".into(),
                    ));
                }
                Ok(ToEngine::Repair(list)) if !repaired => {
                    repaired = true;
                    let mut sub = Vec::with_capacity(list.len());
                    for &i in &list {
                        let spec = expected.get(i as usize).ok_or_else(|| {
                            Failure::Lost(format!("repair names tensor #{i} of {}", expected.len()))
                        })?;
                        sub.push(spec.clone());
                    }
                    let (mut got, frames) = self.transfer(&sub, deadline).await?;
                    let again = self.resolve(&mut got, frames).await;
                    if let Some(&k) = again.first() {
                        return Err(Failure::Mine(format!(
                            "tensor {} failed its checksum again when resent whole",
                            sub[k as usize].name
                        )));
                    }
                    for (&i, t) in list.iter().zip(got) {
                        tensors[i as usize] = t;
                    }
                    need.clear();
                }
                Ok(ToEngine::Repair(_)) => {
                    return Err(Failure::Lost("a second repair of one bucket".into()));
                }
                Err(TcpError::RankFailed { rank, reason }) => {
                    return Err(Failure::Verdict(rank, reason));
                }
                Ok(ToEngine::Close) => return Err(Failure::Closed),
                Ok(other) => return Err(Failure::Lost(format!("unexpected {other:?}"))),
                Err(TcpError::Timeout(m)) => return Err(Failure::Timeout(m)),
                Err(e) => return Err(Failure::Lost(e.to_string())),
            }
        }
    }

    /// Records whole tensors as bases, waits for the deltas (started as their frames came
    /// in) and records their results as bases; returns the positions of deltas that could not
    /// be applied (base missing or not the one named, a malformed delta, or a result whose
    /// checksum differs): rank 0 resends those whole.
    async fn resolve(&mut self, tensors: &mut [OwnedTensor], frames: Frames) -> Vec<u32> {
        let mut applied = Vec::with_capacity(frames.deltas.len());
        for d in frames.deltas {
            applied.push((d.index, d.result, apply::finish(d.work).await));
        }
        let mut need = Vec::new();
        let Ok(mut bases) = self.bases.lock() else {
            return applied.iter().map(|a| a.0 as u32).collect();
        };
        for i in frames.untagged {
            bases.forget(&tensors[i].name);
        }
        for (i, tag, sum) in frames.tagged {
            bases.lend(&tensors[i].name, tag, sum);
        }
        for (index, result, a) in applied {
            let t = &mut tensors[index];
            match a {
                Ok((buf, sum)) if sum == result => {
                    t.bytes = TensorBytes(buf);
                    bases.lend(&t.name, result, result);
                }
                other => {
                    let why = other.map_or_else(|e| e, |_| "the result failed its checksum".into());
                    tracing::warn!(tensor = %t.name, rank = self.rank, %why, "delta not applied; asking for it whole");
                    need.push(index as u32);
                }
            }
        }
        need
    }
}

impl WeightReceiver {
    /// Reads the chain no faster than a `gbps` Gb/s link delivers (later hops are held to it
    /// by flow control): how `troupe bench broadcast --link-gbps` measures, on one machine,
    /// what a sync costs between machines. No effect on the ring.
    pub fn pace_link(&mut self, gbps: f64) -> Result<(), TcpError> {
        self.pace = Some(Pace::gbps(gbps)?);
        Ok(())
    }
}
