//! Resume: the fleet serves again only on one weight version.
//!
//! Clients such as slime update engines directly, so before resuming the plane must learn what
//! every serving engine holds. With SGLang or vLLM engines that is two fan-outs: every engine's
//! `/get_weight_version`, then (if they agree) `/continue_generation`. Engines that honour
//! `If-Match` on `/continue_generation` (Troupe's own, [`Engine::resume_if_match`]) check and
//! resume in one call: the plane asks each to resume if it holds the version the fleet last
//! agreed on, and an engine that holds another answers 412 with it and stays paused. So:
//!
//! - every engine resumed: they all held that version when they resumed (one fan-out);
//! - none resumed, all on one other version (a direct update of the whole fleet): the same
//!   call again with that version (two fan-outs, as the check would have been);
//! - some resumed on it, others hold other versions (a partly failed direct update): the ones
//!   that resumed are paused again in place and the answer is the 409 the check gives. While
//!   they ran, only engines on that one version were serving: never mixed weights.
//!
//! Engines that are routed-but-held (restarted, not yet caught up) are resumed only after the
//! serving ones, as before.

use serde_json::{Map, Value};
use troupe_wire::{ApiError, PauseMode};

use super::control::{InferenceControl, ServerResult};
use super::plane::{ControlPlane, OpState, breakdown, settle};
use crate::Refusal;
use crate::engine_client::version_tag;

impl ControlPlane {
    /// Resumes every engine, unless the engines that serve traffic hold different weight
    /// versions (409 naming them: finish the update first).
    pub async fn resume(&self) -> Result<Value, ApiError> {
        self.refresh().await;
        let mut st = self.op.lock().await;
        let serving = self.serving();
        if let Some(v) = st.agreed.clone()
            && serving.engines().iter().all(|e| e.resume_if_match)
            && let Some(r) = self.resume_checked(&mut st, &serving, v).await
        {
            return r;
        }
        let check = serving.weight_versions().await;
        if !check.consistent() {
            return Err(mixed(
                &check.distinct(),
                &check
                    .versions
                    .iter()
                    .map(|r| ServerResult {
                        url: r.url.clone(),
                        result: r.result.clone().map(Value::String),
                    })
                    .collect::<Vec<_>>(),
                "",
            ));
        }
        st.agreed = check.agreed();
        let (control, skipped) = self.targets();
        let results = control.resume().await;
        if results.iter().all(|r| r.result.is_ok()) {
            st.paused = None;
        }
        settle("resume", &results, &skipped, Map::new())
    }

    /// The one-call resume of engines that honour `If-Match`, starting from `version`; `None`
    /// when `version` cannot be sent as an entity tag (nothing was sent: check first).
    async fn resume_checked(
        &self,
        st: &mut OpState,
        serving: &InferenceControl,
        mut version: String,
    ) -> Option<Result<Value, ApiError>> {
        let engines = serving.engines();
        for attempt in 0..2 {
            let tag = version_tag(&version)?;
            let client = serving.client();
            let outs =
                futures::future::join_all(engines.iter().map(|e| client.resume_if(e, &tag))).await;
            let mut held = Vec::new();
            let mut resumed = Vec::new();
            let results: Vec<ServerResult<Value>> = engines
                .iter()
                .zip(outs)
                .map(|(e, r)| {
                    match &r {
                        Ok(_) => resumed.push(e.url.clone()),
                        Err(Refusal::Version(v)) => held.push(v.clone()),
                        Err(Refusal::Failed(_)) => {}
                    }
                    ServerResult {
                        url: e.url.clone(),
                        result: r.map_err(|e| e.to_string()),
                    }
                })
                .collect();
            if held.is_empty() {
                return Some(self.resume_rest(st, serving, results, version).await);
            }
            held.sort();
            held.dedup();
            if resumed.is_empty() && held.len() == 1 && attempt == 0 {
                // The whole fleet moved to one other version (updated directly): ask again.
                version = held.remove(0);
                continue;
            }
            if resumed.is_empty() {
                return Some(Err(mixed(&held, &results, "")));
            }
            held.push(version.clone());
            held.sort();
            held.dedup();
            let again = serving
                .subset(resumed.clone())
                .pause(PauseMode::InPlace)
                .await;
            let still = again.iter().filter(|r| r.result.is_err()).count();
            let note = format!(
                "; the {} engines on {version:?} that resumed were paused again in place{}",
                resumed.len(),
                if still > 0 {
                    format!(" ({still} of them did not answer the pause)")
                } else {
                    String::new()
                }
            );
            return Some(Err(mixed(&held, &results, &note)));
        }
        None
    }

    /// Every serving engine resumed on `version`: resume the routed-but-held ones too and
    /// answer for all.
    async fn resume_rest(
        &self,
        st: &mut OpState,
        serving: &InferenceControl,
        mut results: Vec<ServerResult<Value>>,
        version: String,
    ) -> Result<Value, ApiError> {
        let (control, skipped) = self.targets();
        let serving_urls: std::collections::HashSet<String> = serving.urls().into_iter().collect();
        let rest: Vec<String> = control
            .urls()
            .into_iter()
            .filter(|u| !serving_urls.contains(u))
            .collect();
        if !rest.is_empty() {
            results.extend(control.subset(rest).resume().await);
        }
        st.agreed = Some(version);
        if results.iter().all(|r| r.result.is_ok()) {
            st.paused = None;
        }
        settle("resume", &results, &skipped, Map::new())
    }
}

/// 409: the serving engines hold `versions`; `results` is each engine's answer.
fn mixed(versions: &[String], results: &[ServerResult<Value>], note: &str) -> ApiError {
    ApiError::conflict(format!(
        "engines hold different weight versions {versions:?}; refusing to resume serving on mixed weights: finish the weight update so every engine has one version, then resume{note}"
    ))
    .control()
    .with_engines(breakdown(results))
}
