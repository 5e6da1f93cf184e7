//! Resume: the fleet serves again only on one weight version. The one home of that rule: the
//! plane's resume (gateway control endpoints, the controller) and the gRPC API's
//! `EndWeightUpdate` both call [`InferenceControl::resume_on_one_version`].
//!
//! Clients such as slime update engines directly, so before resuming, what every serving engine
//! holds must be learnt. With SGLang or vLLM engines that is two fan-outs: every engine's
//! `/get_weight_version`, then (if they agree) `/continue_generation`. Engines that honour
//! `If-Match` on `/continue_generation` (Troupe's own, [`Engine::resume_if_match`]) check and
//! resume in one call: each is asked to resume if it holds the version the fleet is expected to
//! hold, and one that holds another answers 412 with it and stays paused. So:
//!
//! - every engine resumed: they all held that version when they resumed (one fan-out);
//! - none resumed, all on one other version (a direct update of the whole fleet): the same
//!   call again with that version (two fan-outs, as the check would have been);
//! - some resumed on it, others hold other versions (a partly failed direct update): the ones
//!   that resumed are paused again in place and the answer is [`Mixed`], as the check gives.
//!   While they ran, only engines on that one version were serving: never mixed weights.
//!
//! Engines that are routed-but-held (restarted, not yet caught up) are resumed only after the
//! serving ones agreed.
//!
//! [`Engine::resume_if_match`]: super::Engine::resume_if_match

use std::collections::HashSet;

use serde_json::{Map, Value};
use troupe_wire::{ApiError, PauseMode, WeightVersion};

use super::answer::{breakdown, settle};
use super::control::{InferenceControl, ServerResult, shown};
use super::plane::ControlPlane;
use crate::Refusal;
use crate::engine_client::version_tag;
use crate::engines::EngineDialect;

/// A resume that went ahead: the serving engines agreed on `version`.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The version the serving engines hold (`None`: none of them answered).
    pub version: Option<WeightVersion>,
    /// The serving engines known to hold it.
    pub reached: Vec<String>,
    /// Every engine's answer to the resume (the serving ones, then the rest).
    pub results: Vec<ServerResult<Value>>,
}

/// A resume refused: the serving engines hold different versions, and none is left resumed by
/// it (unless the pause that undoes an engine's resume failed: `undone` says so).
#[derive(Debug, Clone)]
pub struct Mixed {
    /// The versions found, sorted (by step, then text).
    pub versions: Vec<WeightVersion>,
    /// Each serving engine's version, or its refusal or error.
    pub results: Vec<ServerResult<Value>>,
    /// What was undone (engines that had resumed and were paused again), if anything.
    pub undone: String,
}

impl Mixed {
    /// What is wrong and how to fix it.
    pub fn message(&self) -> String {
        format!(
            "engines hold different weight versions {:?}; refusing to resume serving on mixed weights: finish the weight update so every engine has one version, then resume{}",
            shown(&self.versions),
            self.undone
        )
    }
}

impl From<Mixed> for ApiError {
    /// 409 with each engine's answer.
    fn from(m: Mixed) -> Self {
        ApiError::conflict(m.message())
            .control()
            .with_engines(breakdown(&m.results))
    }
}

impl InferenceControl {
    /// Resumes these engines (the ones that serve traffic) only if they all hold one weight
    /// version, then the engines of `rest` (held ones: not routed, so not checked). `expected`
    /// is the version they are thought to hold (usually [`Fleet::expected_version`]): when every
    /// engine here honours `If-Match`, the check and the resume are one call; otherwise (or
    /// with no guess) the versions are read first. The version they resumed on becomes the
    /// fleet's expectation.
    ///
    /// [`Fleet::expected_version`]: super::Fleet::expected_version
    pub async fn resume_on_one_version(
        &self,
        rest: Option<&InferenceControl>,
        expected: Option<&WeightVersion>,
    ) -> Result<Resumed, Mixed> {
        let engines = self.engines();
        // `If-Match` is honoured on SGLang's route (`/continue_generation`) only.
        let one_call = engines
            .iter()
            .all(|e| e.resume_if_match && e.dialect == EngineDialect::Sglang);
        let tried = match expected.filter(|_| one_call) {
            Some(v) => self.resume_if(v).await,
            None => None,
        };
        let mut r = match tried {
            Some(r) => r?,
            None => self.check_then_resume().await?,
        };
        if let Some(v) = &r.version {
            self.fleet().expect_version(v);
        }
        if let Some(rest) = rest.filter(|r| !r.engines().is_empty()) {
            r.results.extend(rest.resume().await);
        }
        Ok(r)
    }

    /// Reads every version, then resumes if they agree (two fan-outs).
    async fn check_then_resume(&self) -> Result<Resumed, Mixed> {
        let check = self.weight_versions().await;
        if !check.consistent() {
            return Err(Mixed {
                versions: check.distinct(),
                results: check.answers(),
                undone: String::new(),
            });
        }
        Ok(Resumed {
            version: check.agreed(),
            reached: check.reached(),
            results: self.resume().await,
        })
    }

    /// The one-call resume, starting from `version`; `None` when a version cannot be sent as
    /// an entity tag (nothing was sent: check first).
    async fn resume_if(&self, version: &WeightVersion) -> Option<Result<Resumed, Mixed>> {
        let mut version = version.clone();
        let mut asked = 0;
        loop {
            asked += 1;
            let tag = version_tag(version.as_str())?;
            let outs = self
                .fan_out_patient("resume", move |c, e| {
                    let tag = tag.clone();
                    async move { c.resume_if(&e, &tag).await }
                })
                .await;
            let mut held: Vec<WeightVersion> = Vec::new();
            let mut resumed = Vec::new();
            let results: Vec<ServerResult<Value>> = outs
                .into_iter()
                .map(|r| {
                    match &r.result {
                        Ok(Ok(_)) => resumed.push(r.url.clone()),
                        // A refusal naming no version (empty, control characters) does not
                        // parse: it is that engine's failure (`Refusal::Failed`), and its
                        // answer says why.
                        Ok(Err(Refusal::Version(v))) => held.push(v.clone()),
                        Ok(Err(Refusal::Failed(_))) | Err(_) => {}
                    }
                    ServerResult {
                        url: r.url,
                        result: r
                            .result
                            .and_then(|a| a.map(Value::from).map_err(|e| e.to_string())),
                    }
                })
                .collect();
            if held.is_empty() {
                return Some(Ok(Resumed {
                    version: (!resumed.is_empty()).then_some(version),
                    reached: resumed,
                    results,
                }));
            }
            held.sort();
            held.dedup();
            if resumed.is_empty() && held.len() == 1 {
                if asked == 1 {
                    // The whole fleet moved to one other version (updated directly): ask again.
                    version = held.remove(0);
                    continue;
                }
                // It moved again in between (an update racing the resume): read, then resume.
                return Some(self.check_then_resume().await);
            }
            let mut undone = String::new();
            if !resumed.is_empty() {
                held.push(version.clone());
                held.sort();
                held.dedup();
                let n = resumed.len();
                let again = self.subset(resumed).pause(PauseMode::InPlace).await;
                let missed = again.iter().filter(|r| r.result.is_err()).count();
                let who = if n == 1 {
                    "the engine".to_string()
                } else {
                    format!("the {n} engines")
                };
                undone = format!(
                    "; {who} on {:?} that had resumed {} paused again in place{}",
                    version.as_str(),
                    if n == 1 { "was" } else { "were" },
                    if missed > 0 {
                        format!(" ({missed} of them did not answer the pause)")
                    } else {
                        String::new()
                    }
                );
            }
            return Some(Err(Mixed {
                versions: held,
                results,
                undone,
            }));
        }
    }
}

impl ControlPlane {
    /// Resumes every engine, unless the engines that serve traffic hold different weight
    /// versions (409 naming them: finish the update first).
    pub async fn resume(&self) -> Result<Value, ApiError> {
        self.refresh().await;
        let st = self.op.lock().await;
        let serving = self.serving();
        let (control, skipped) = self.targets();
        let checked: HashSet<String> = serving.urls().into_iter().collect();
        let rest = control.subset(
            control
                .urls()
                .into_iter()
                .filter(|u| !checked.contains(u))
                .collect(),
        );
        let expected = self.fleet().expected_version();
        let r = serving
            .resume_on_one_version(Some(&rest), expected.as_ref())
            .await?;
        if r.results.iter().all(|r| r.result.is_ok()) {
            self.set_status(&st, |s| s.paused = None);
        }
        settle("resume", &r.results, &skipped, Map::new())
    }
}
