//! Rolling updates (`weights.rollout: rolling`): instead of pausing the whole fleet, an update
//! goes to a part of it at a time while the rest serves. Each part is taken out of routing
//! (the fleet's version hook), drained (the requests already on it finish, for at most
//! `rolling_drain`, so the pause catches none of them and no client waits for the load), updated
//! as a whole fleet would be (paused, sent, committed, resumed: all or nothing within the
//! part), told its new version and routed again; then the next part. Parts hold the same share of every role, so prefill and decode pairs on one
//! version exist throughout (the router pairs by version, `troupe_router::pinned`). A request is
//! served by one engine at a time, so the staleness bound holds per request as it does for a
//! stop-the-world update; requests that ask for a version are routed by it.
//!
//! A part that fails stops the rollout: the parts before it serve the new version, the rest the
//! old one (both whole versions), and the report says which engine holds what.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::super::control::InferenceControl;
use super::super::outcome::{EngineOutcome, Outcome};
use super::super::tensors::HostTensor;
use super::{Core, UpdateReport, WeightSyncError};
use crate::engines::Engine;

/// How an update reaches the fleet (`weights.rollout`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Rollout {
    /// Every engine at once: the fleet pauses, takes the update and resumes together.
    #[default]
    All,
    /// A part at a time, each out of routing while it updates, the rest serving.
    Rolling(PartSize),
}

/// How much of each role one step of a rolling update takes (at least one engine).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PartSize {
    /// This share of each role's engines (in `(0, 1]`), rounded up.
    Fraction(f64),
    /// This many engines of each role.
    Count(usize),
}

impl PartSize {
    /// The part size for a role of `n` engines: at least 1, at most `n`.
    pub fn of(self, n: usize) -> usize {
        let k = match self {
            PartSize::Fraction(f) if f.is_finite() && f > 0.0 => (n as f64 * f).ceil() as usize,
            PartSize::Fraction(_) => 1,
            PartSize::Count(c) => c,
        };
        k.clamp(1, n.max(1))
    }
}

/// Splits `engines` into the parts of a rolling update: each role's engines (in fleet order) in
/// chunks of `size`, part `i` holding the `i`-th chunk of every role.
pub fn parts(engines: &[Engine], size: PartSize) -> Vec<Vec<Engine>> {
    let mut by_role: BTreeMap<Option<troupe_wire::WorkerType>, Vec<Engine>> = BTreeMap::new();
    for e in engines {
        by_role.entry(e.role).or_default().push(e.clone());
    }
    let mut out: Vec<Vec<Engine>> = Vec::new();
    for group in by_role.values() {
        for (i, chunk) in group.chunks(size.of(group.len())).enumerate() {
            if out.len() <= i {
                out.push(Vec::new());
            }
            out[i].extend(chunk.iter().cloned());
        }
    }
    out
}

/// How often a draining part's requests in flight are counted.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// Waits until no request is in flight on `urls` (held out of routing just before), or `most`
/// passed, or the fleet's router cannot count them.
async fn drain(fleet: &super::super::fleet::Fleet, urls: &[String], most: Duration) {
    let deadline = Instant::now() + most;
    loop {
        match fleet.in_flight(urls).await {
            None | Some(0) => return,
            Some(n) if Instant::now() >= deadline => {
                tracing::warn!(
                    servers = ?urls,
                    "{n} requests still in flight after draining for {most:?}; pausing the part all the same"
                );
                return;
            }
            Some(_) => tokio::time::sleep(DRAIN_POLL).await,
        }
    }
}

impl Core {
    /// [`Core::update_weights`] one part at a time (module docs).
    pub(super) async fn update_rolling(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        version: &troupe_wire::WeightVersion,
        tensors: &[HostTensor],
        size: PartSize,
    ) -> Result<UpdateReport, WeightSyncError> {
        let fleet = control.fleet().clone();
        let (live, skipped) = super::super::fleet::reachable(&fleet, engines);
        let mut report: Option<UpdateReport> = None;
        let all_parts = parts(&live, size);
        // Encoded once: every part is sent the same bytes.
        let prepared = self.prepare(tensors)?;
        for (k, part) in all_parts.iter().enumerate() {
            let urls: Vec<String> = part.iter().map(|e| e.url.clone()).collect();
            fleet.tell_routable(&urls, false).await;
            drain(&fleet, &urls, self.opts.rolling_drain).await;
            let r = self
                .update_weights(control, part, version, prepared.clone(), false)
                .await;
            // The part's group is left by the part itself: the next part (another member set)
            // builds its own, and an engine must not still be joined when its part comes round
            // again in the next update.
            self.drop_group(&control.subset(urls.clone())).await;
            let back: Vec<String> = match &r {
                Ok(rep) => rep
                    .engines
                    .iter()
                    .filter(|o| o.outcome != Outcome::HeldOut)
                    .map(|o| o.url.clone())
                    .collect(),
                Err(WeightSyncError::Update { engines, .. }) => engines
                    .iter()
                    .filter(|o| o.outcome != Outcome::HeldOut)
                    .map(|o| o.url.clone())
                    .collect(),
                Err(_) => urls.clone(),
            };
            fleet.tell_routable(&back, true).await;
            match r {
                Ok(rep) => {
                    report = Some(match report.take() {
                        None => rep,
                        Some(mut acc) => {
                            acc.seconds += rep.seconds;
                            acc.buckets += rep.buckets;
                            acc.sent_bytes += rep.sent_bytes;
                            acc.engines.extend(rep.engines);
                            acc
                        }
                    });
                }
                Err(WeightSyncError::Update {
                    version: v,
                    reason,
                    after,
                    engines: mut out,
                }) => {
                    let done = report.map(|r| r.engines).unwrap_or_default();
                    let rest = all_parts[k + 1..].iter().flatten().map(|e| EngineOutcome {
                        url: e.url.clone(),
                        staged: false,
                        outcome: Outcome::Unchanged,
                    });
                    let mut all = done;
                    all.append(&mut out);
                    all.extend(rest);
                    return Err(WeightSyncError::Update {
                        version: v,
                        reason: format!(
                            "rolling update, part {} of {}: {reason}",
                            k + 1,
                            all_parts.len()
                        ),
                        after: format!(
                            "{after}; earlier parts serve {version}, later ones their earlier weights"
                        ),
                        engines: all,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        let mut rep = report.ok_or_else(|| WeightSyncError::Update {
            version: version.clone(),
            reason: format!("every server is down: {skipped:?}"),
            after: "nothing changed".into(),
            engines: Vec::new(),
        })?;
        rep.skipped = skipped.iter().map(|s| s.to_string()).collect();
        rep.engines.extend(skipped.iter().map(|u| EngineOutcome {
            url: u.to_string(),
            staged: false,
            outcome: Outcome::Skipped,
        }));
        Ok(rep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_wire::WorkerType;

    #[test]
    fn parts_take_a_share_of_every_role() {
        let e = |u: &str, r| Engine::sglang(u, 1).with_role(r);
        let fleet = [
            e("p1", WorkerType::Prefill),
            e("p2", WorkerType::Prefill),
            e("d1", WorkerType::Decode),
            e("d2", WorkerType::Decode),
            e("d3", WorkerType::Decode),
            e("d4", WorkerType::Decode),
        ];
        let urls = |p: &Vec<Engine>| p.iter().map(|e| e.url.clone()).collect::<Vec<_>>();
        let ps = parts(&fleet, PartSize::Fraction(0.5));
        assert_eq!(
            ps.iter().map(urls).collect::<Vec<_>>(),
            [["p1", "d1", "d2"], ["p2", "d3", "d4"]]
        );
        let ps = parts(&fleet, PartSize::Count(1));
        assert_eq!(ps.len(), 4);
        assert_eq!(urls(&ps[0]), ["p1", "d1"]);
        assert_eq!(urls(&ps[3]), ["d4"]);
        assert_eq!(PartSize::Fraction(0.0).of(4), 1);
        assert_eq!(PartSize::Count(9).of(4), 4);
    }
}
