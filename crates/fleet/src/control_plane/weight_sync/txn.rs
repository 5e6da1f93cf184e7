//! The transaction of one update, after the buckets: which engines stage it, the commit when
//! every bucket reached every engine, the abandon when one did not, and the resume of what
//! serves one version afterwards (`super::super::outcome` says why).

use std::collections::HashSet;
use std::time::Duration;

use super::super::control::InferenceControl;
use super::super::fleet::Fleet;
use super::super::outcome::{EngineOutcome, Outcome, Staging};
use super::Core;
use crate::engines::Engine;

/// How long reading whether an engine stages may take (it answered the pause just before).
const STAGING_READ_TIMEOUT: Duration = Duration::from_secs(10);

impl Core {
    /// Which of `engines` stage this update: those whose `/server_info` says so (read once per
    /// engine and fleet generation), unless staging is off. An engine that cannot be asked is
    /// taken not to stage (it is then held out if the update fails after reaching it).
    pub(super) async fn staging_engines(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        generation: u64,
    ) -> HashSet<String> {
        if self.opts.staging == Staging::Off {
            return HashSet::new();
        }
        let reads = control.client().clone().with_timeout(STAGING_READ_TIMEOUT);
        let unknown: Vec<&Engine> = engines
            .iter()
            .filter(|e| {
                self.stages
                    .get(&e.url)
                    .is_none_or(|(g, _)| *g != generation)
            })
            .collect();
        let answers = futures::future::join_all(unknown.iter().map(|e| {
            let reads = &reads;
            async move { (e.url.clone(), reads.weight_staging(e).await) }
        }))
        .await;
        for (url, r) in answers {
            match r {
                Ok(s) => {
                    self.stages.insert(url, (generation, s));
                }
                Err(e) => tracing::warn!(
                    engine = %url,
                    "cannot tell whether it stages weight updates ({e}); sending as to one that does not"
                ),
            }
        }
        engines
            .iter()
            .filter(|e| self.stages.get(&e.url).is_some_and(|(_, s)| *s))
            .map(|e| e.url.clone())
            .collect()
    }

    /// Before the first bucket: every staging engine drops whatever an earlier update left
    /// staged on it (an abort that never reached a frozen or partitioned engine), so this
    /// update's commit swaps in this update's buckets and nothing else.
    pub(super) async fn clear_staged(
        &self,
        control: &InferenceControl,
        engines: &[Engine],
        staged: &HashSet<String>,
    ) -> Result<(), String> {
        let answers =
            futures::future::join_all(engines.iter().filter(|e| staged.contains(&e.url)).map(
                |e| async move {
                    control
                        .client()
                        .abort_weight_update(e)
                        .await
                        .map_err(|err| {
                            format!("{}: clearing what an earlier update staged: {err}", e.url)
                        })
                },
            ))
            .await;
        let errs: Vec<String> = answers.into_iter().filter_map(Result::err).collect();
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("; "))
        }
    }

    /// Every bucket reached every engine: the staging ones swap the update in, all at once.
    /// One whose commit goes unanswered may or may not have: it is held out.
    pub(super) async fn commit(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        staged: &HashSet<String>,
        version: &troupe_wire::WeightVersion,
        fleet: &Fleet,
    ) -> Vec<EngineOutcome> {
        let commits = futures::future::join_all(engines.iter().map(|e| async move {
            if !staged.contains(&e.url) {
                return Outcome::Applied;
            }
            match control.client().commit_weight_update(e, version).await {
                Ok(_) => Outcome::Committed,
                Err(err) => {
                    tracing::error!(engine = %e.url, "commit of weight version {version} unanswered ({err}); held out until a complete update reaches it");
                    Outcome::HeldOut
                }
            }
        }))
        .await;
        engines
            .iter()
            .zip(commits)
            .map(|(e, outcome)| {
                if outcome == Outcome::HeldOut {
                    self.tainted.insert(e.url.clone());
                    fleet.hold_out(&e.url);
                }
                EngineOutcome {
                    url: e.url.clone(),
                    staged: staged.contains(&e.url),
                    outcome,
                }
            })
            .collect()
    }

    /// After a failed update: the staging engines drop what they staged (an engine that does
    /// not answer never got a commit, so it serves what it served before all the same); those
    /// that apply as they receive are held out once a bucket went out.
    pub(super) async fn abandon(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        staged: &HashSet<String>,
        began: bool,
        fleet: &Fleet,
    ) -> Vec<EngineOutcome> {
        futures::future::join_all(
            engines
                .iter()
                .filter(|e| staged.contains(&e.url))
                .map(|e| async move {
                    if let Err(err) = control.client().abort_weight_update(e).await {
                        tracing::warn!(engine = %e.url, "abort of a staged weight update unanswered ({err}); it was never committed, so the engine serves its earlier weights");
                    }
                }),
        )
        .await;
        engines
            .iter()
            .map(|e| {
                let is_staged = staged.contains(&e.url);
                let outcome = match (is_staged, began) {
                    (true, _) => Outcome::Discarded,
                    (false, false) => Outcome::Unchanged,
                    (false, true) => {
                        self.tainted.insert(e.url.clone());
                        fleet.hold_out(&e.url);
                        Outcome::HeldOut
                    }
                };
                EngineOutcome {
                    url: e.url.clone(),
                    staged: is_staged,
                    outcome,
                }
            })
            .collect()
    }

    /// After a failed update: resume only if every engine of `control` serves one version.
    /// What happened, and the version they resumed on (`None`: they stay paused).
    pub(super) async fn recover(
        &self,
        control: &InferenceControl,
        keep_paused: bool,
    ) -> (String, Option<troupe_wire::WeightVersion>) {
        if keep_paused {
            let msg = format!(
                "servers stay paused as the caller left them; versions now {:?}",
                super::super::control::shown(&control.weight_versions().await.distinct())
            );
            return (msg, None);
        }
        // No version to expect after a failure: read them first.
        match control.resume_on_one_version(None, None).await {
            Ok(r) => {
                let ok = r.results.iter().filter(|r| r.result.is_ok()).count();
                let reached: HashSet<&String> = r.reached.iter().collect();
                let unreachable: Vec<String> = control
                    .urls()
                    .into_iter()
                    .filter(|u| !reached.contains(u))
                    .collect();
                let msg = format!(
                    "{ok} reachable servers resumed on one weight version {}; unreachable: {unreachable:?}",
                    r.version
                        .as_ref()
                        .map_or("", troupe_wire::WeightVersion::as_str),
                );
                (msg, r.version)
            }
            Err(m) => (
                format!(
                    "servers hold different weight versions {:?}, so they stay paused; call update_weights again to bring every server to one version and resume",
                    super::super::control::shown(&m.versions)
                ),
                None,
            ),
        }
    }
}
