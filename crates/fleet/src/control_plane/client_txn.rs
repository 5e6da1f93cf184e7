//! A client's own broadcast as one transaction: what the controller's gRPC API runs for an
//! external trainer (`BeginWeightUpdate`, `WeightBucket`…, `EndWeightUpdate`).
//!
//! Without it, each bucket went into the engines as it came, so a trainer killed after some
//! buckets left every engine paused on part of the update, still labelled with the old version;
//! whoever resumed the fleet next (an operator, the trainer restarted) served that mix. Now
//! [`ControlPlane::begin_update`] pauses the fleet and opens a [`ClientTxn`]: buckets are staged
//! on the engines that can (`troupe_wire::staging`), and the others (SGLang, vLLM) apply them as
//! they come and are remembered. [`ControlPlane::end_update`] commits the staged ones all at
//! once, labels the others, records the version and resumes. A bucket that fails (the sender
//! died: the engines' reads of it break; an engine refused it) ends the transaction at once:
//! staged buckets are dropped, engines that applied some are held out of routing until the next
//! complete update reaches them, and the rest resume on the weights they had. The end of a
//! failed transaction, or one whose bucket count the trainer names and the plane did not see,
//! is refused and serves nothing of it. A `BeginWeightUpdate` while one is open (the trainer
//! restarted) drops the open one the same way first.

use std::collections::{BTreeSet, HashSet};

use serde_json::Value;
use troupe_wire::{ApiError, PauseMode};

use super::control::ServerResult;
use super::op_state::{ClientTxn, LastUpdate, OpState};
use super::plane::ControlPlane;
use crate::engines::Engine;

fn conflict(msg: String) -> ApiError {
    ApiError::conflict(msg).control()
}

impl ControlPlane {
    /// Pauses the fleet in `mode` and opens a transaction for a client's buckets (module docs).
    /// An open one is abandoned first.
    pub async fn begin_update(&self, mode: PauseMode) -> Result<Value, ApiError> {
        {
            let mut st = self.op.lock().await;
            if st.txn.is_some() {
                self.abandon(&mut st, "a new update began").await;
                st.txn = None;
            }
        }
        let paused = self.pause(mode, false).await?;
        let mut st = self.op.lock().await;
        let (control, _) = self.targets();
        let engines = control.engines();
        let reads = control
            .client()
            .clone()
            .with_timeout(std::time::Duration::from_secs(10));
        let stages = futures::future::join_all(engines.iter().map(|e| {
            let reads = &reads;
            async move { (e, reads.weight_staging(e).await.unwrap_or(false)) }
        }))
        .await;
        let staged: HashSet<String> = stages
            .into_iter()
            .filter(|(_, s)| *s)
            .map(|(e, _)| e.url.clone())
            .collect();
        // Whatever an earlier update left staged (an abort that never arrived) goes now.
        for e in engines.iter().filter(|e| staged.contains(&e.url)) {
            if let Err(err) = control.client().abort_weight_update(e).await {
                return Err(ApiError::bad_gateway(format!(
                    "{}: clearing what an earlier update staged: {err}",
                    e.url
                ))
                .control());
            }
        }
        st.txn = Some(ClientTxn {
            staged,
            ..ClientTxn::default()
        });
        Ok(paused)
    }

    /// The refusal of a bucket sent after its transaction failed.
    pub(crate) fn txn_refusal(st: &OpState) -> Option<ApiError> {
        let why = st.txn.as_ref()?.failed.as_ref()?;
        Some(conflict(format!(
            "this weight update was abandoned ({why}); nothing of it is served. Call BeginWeightUpdate to start again"
        )))
    }

    /// Records a bucket of the open transaction that every member took.
    pub(crate) fn txn_took(
        st: &mut OpState,
        members: &[Engine],
        version: Option<&troupe_wire::WeightVersion>,
    ) {
        if let Some(t) = st.txn.as_mut() {
            t.buckets += 1;
            for e in members {
                t.reached.insert(e.url.clone(), e.clone());
            }
            if let Some(v) = version {
                t.version = Some(v.clone());
            }
        }
    }

    /// A bucket of the open transaction failed on some member: the transaction ends (module
    /// docs) and the error says what the engines hold now.
    pub(crate) async fn txn_failed(
        &self,
        st: &mut OpState,
        members: &[Engine],
        error: ApiError,
    ) -> ApiError {
        if let Some(t) = st.txn.as_mut() {
            for e in members {
                t.reached.insert(e.url.clone(), e.clone());
            }
        }
        let after = self.abandon(st, &error.message).await;
        let mut e = error;
        e.message = format!("{}; the update is abandoned: {after}", e.message);
        e
    }

    /// Ends the open transaction without serving any of it: staged buckets dropped, engines
    /// that applied some held out, the rest resumed on what they had. What happened.
    async fn abandon(&self, st: &mut OpState, why: &str) -> String {
        let Some(t) = st.txn.as_mut() else {
            return String::new();
        };
        if t.failed.is_some() {
            return "it had already ended".into();
        }
        t.failed = Some(why.to_string());
        let control = self.control();
        let held: Vec<String> = t
            .reached
            .keys()
            .filter(|u| !t.staged.contains(*u))
            .cloned()
            .collect();
        for e in t.reached.values().filter(|e| t.staged.contains(&e.url)) {
            if let Err(err) = control.client().abort_weight_update(e).await {
                tracing::warn!(engine = %e.url, "abort of a staged client update unanswered ({err}); never committed, so it serves its earlier weights");
            }
        }
        for u in &held {
            self.fleet().hold_out(u);
        }
        let (targets, _) = self.targets();
        let held_set: BTreeSet<&String> = held.iter().collect();
        let clean: Vec<String> = targets
            .urls()
            .into_iter()
            .filter(|u| !held_set.contains(u))
            .collect();
        let resumed = control
            .subset(clean.clone())
            .resume_on_one_version(None, None)
            .await;
        let on = match resumed {
            Ok(r) => {
                self.set_status(st, |s| s.paused = None);
                format!(
                    "{} servers resumed on their earlier weights ({})",
                    clean.len(),
                    r.version
                        .as_ref()
                        .map_or("", troupe_wire::WeightVersion::as_str)
                )
            }
            Err(m) => format!(
                "servers hold different versions {:?} and stay paused",
                super::control::shown(&m.versions)
            ),
        };
        if held.is_empty() {
            on
        } else {
            format!(
                "{on}; held out (paused, unrouted) until a complete update reaches them, as they apply buckets as they arrive: {held:?}"
            )
        }
    }

    /// Ends the open transaction: every staged bucket is committed at once, engines that
    /// applied theirs are labelled, the version is recorded and the fleet resumes. With
    /// `buckets`, the trainer's own count must match what every engine took. Without an open
    /// transaction, a plain resume.
    pub async fn end_update(&self, buckets: Option<u64>) -> Result<Value, ApiError> {
        let txn = {
            let mut st = self.op.lock().await;
            if let Some(n) = buckets
                && let Some(t) = st.txn.as_ref()
                && t.failed.is_none()
                && t.buckets != n
            {
                let seen = t.buckets;
                let after = self
                    .abandon(
                        &mut st,
                        &format!("the trainer sent {n} buckets and every engine took {seen}"),
                    )
                    .await;
                st.txn = None;
                return Err(conflict(format!(
                    "the trainer sent {n} buckets and every engine took {seen}; the update is abandoned: {after}"
                )));
            }
            st.txn.take()
        };
        let Some(t) = txn else {
            return self.resume().await;
        };
        if let Some(why) = t.failed {
            return Err(conflict(format!(
                "this weight update was abandoned ({why}); nothing of it is served"
            )));
        }
        if t.buckets > 0 {
            self.commit_txn(t).await?;
        }
        self.resume().await
    }

    /// Commits `t` on every engine it reached and records its version.
    async fn commit_txn(&self, t: ClientTxn) -> Result<(), ApiError> {
        let Some(version) = t.version.clone() else {
            let mut st = self.op.lock().await;
            st.txn = Some(t);
            let after = self
                .abandon(&mut st, "no bucket named a weight_version")
                .await;
            st.txn = None;
            return Err(conflict(format!(
                "no bucket named a weight_version, so the update cannot be labelled; it is abandoned: {after}"
            )));
        };
        let mut st = self.op.lock().await;
        let control = self.control();
        let v = &version;
        let t = &t;
        let results: Vec<ServerResult<Value>> =
            futures::future::join_all(t.reached.values().map(|e| async move {
                let r = if t.stages(&e.url) {
                    control
                        .client()
                        .commit_weight_update(e, v)
                        .await
                        .map(Value::from)
                } else {
                    control.client().set_version(e, v).await.map(Value::from)
                };
                ServerResult {
                    url: e.url.clone(),
                    result: r.map_err(|err| err.to_string()),
                }
            }))
            .await;
        let reached: Vec<String> = results
            .iter()
            .filter(|r| r.result.is_ok())
            .map(|r| r.url.clone())
            .collect();
        for r in results.iter().filter(|r| r.result.is_err()) {
            // It may or may not have swapped the update in: out of routing until the next.
            self.fleet().hold_out(&r.url);
        }
        self.fleet().updated(v, &reached);
        self.fleet().tell_versions(&reached, Some(v)).await;
        st.last = Some(LastUpdate::Broadcast);
        if reached.len() < results.len() {
            return Err(super::answer::failure(
                "commit_weight_update",
                &results,
                &[],
                "the engines that did not answer are held out until the next complete update",
            ));
        }
        Ok(())
    }
}
