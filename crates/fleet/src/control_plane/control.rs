//! The inference control plane: pause, resume, flush, memory, server info — sent to every
//! server directly and concurrently, never through the router (a paused router must not stand
//! between the controller and a server it needs to resume).

use std::sync::Arc;

use serde_json::Value;
use troupe_wire::answers::ServerInfo;
use troupe_wire::{PauseMode, WeightVersion};

use super::catch_up::ControlHandle;
use super::stale::{Reconcile, STALE_PATIENCE, Stale};
use crate::engines::Engine;
use crate::{EngineCallError, EngineClient};

/// One server's outcome of a fanned-out control call.
#[derive(Debug, Clone)]
pub struct ServerResult<T> {
    /// The server.
    pub url: String,
    /// What it answered, or why it failed.
    pub result: Result<T, String>,
}

/// Control-plane client for the serving heads. Clones share one server list, which changes
/// only when a lost server is re-placed elsewhere (its slot gets the new URL). Every call goes
/// through [`EngineClient`], the one place that speaks engines' control endpoints.
#[derive(Clone)]
pub struct InferenceControl {
    engines: Arc<std::sync::RwLock<Vec<Engine>>>,
    client: EngineClient,
    fleet: Arc<super::fleet::Fleet>,
}

/// A patient call not yet answered, polled in place by its caller: handed to the reconciler
/// (which then drives it on a task of its own) if it is still open when the caller stops
/// waiting (timeout, or the caller's future dropped), or cut when nobody reconciles.
struct Open<T: Send + 'static> {
    call: Option<futures::future::BoxFuture<'static, T>>,
    engine: Engine,
    op: &'static str,
    /// `None`: nobody reconciles, so an unanswered call is cut.
    reconciler: Option<Arc<dyn Reconcile>>,
}

impl<T: Send + 'static> Drop for Open<T> {
    fn drop(&mut self) {
        let (Some(call), Some(reconciler)) = (self.call.take(), &self.reconciler) else {
            return;
        };
        reconciler.reconcile(Stale {
            engine: self.engine.clone(),
            op: self.op,
            call: Box::pin(async move {
                let _ = call.await;
            }),
        });
    }
}

/// Per-server results of calls that answer `Result<Value, EngineCallError>`, as one result each.
fn flatten<T: Into<Value>>(
    results: Vec<ServerResult<Result<T, EngineCallError>>>,
) -> Vec<ServerResult<Value>> {
    results
        .into_iter()
        .map(|r| ServerResult {
            url: r.url,
            result: r
                .result
                .and_then(|a| a.map(Into::into).map_err(|e| e.to_string())),
        })
        .collect()
}

/// The versions of `vs` as their text, for messages (`["v1", "v2"]`, as a list of strings
/// is shown).
pub(crate) fn shown(vs: &[WeightVersion]) -> Vec<&str> {
    vs.iter().map(WeightVersion::as_str).collect()
}

/// Turns per-server results into one error naming every server that failed, if any did.
pub fn all_ok<T>(results: &[ServerResult<T>]) -> Result<(), String> {
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.result.as_ref().err().map(|e| format!("{}: {e}", r.url)))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// The engines' weight versions, asked all at once: the one rule of "versions must agree
/// before resume", shared by the weight sync and the gRPC API.
#[derive(Debug, Clone)]
pub struct VersionCheck {
    /// Each engine's answer.
    pub versions: Vec<ServerResult<WeightVersion>>,
}

impl VersionCheck {
    /// The distinct versions the reachable engines serve, sorted (by step, then text).
    pub fn distinct(&self) -> Vec<WeightVersion> {
        let mut seen: Vec<WeightVersion> = self
            .versions
            .iter()
            .filter_map(|r| r.result.as_ref().ok().cloned())
            .collect();
        seen.sort();
        seen.dedup();
        seen
    }

    /// The one version every reachable engine serves, if they agree (and one answered).
    pub fn agreed(&self) -> Option<WeightVersion> {
        match self.distinct().as_slice() {
            [one] => Some(one.clone()),
            _ => None,
        }
    }

    /// Whether the reachable engines agree (no answer at all counts as agreeing: nothing to
    /// disagree with).
    pub fn consistent(&self) -> bool {
        self.distinct().len() <= 1
    }

    /// Each engine's version (or why it gave none), as a fan-out's per-engine answers.
    pub fn answers(&self) -> Vec<ServerResult<Value>> {
        self.versions
            .iter()
            .map(|r| ServerResult {
                url: r.url.clone(),
                result: r.result.clone().map(|v| Value::String(v.to_string())),
            })
            .collect()
    }

    /// The engines that answered.
    pub fn reached(&self) -> Vec<String> {
        self.versions
            .iter()
            .filter(|r| r.result.is_ok())
            .map(|r| r.url.clone())
            .collect()
    }

    /// The engines that did not answer.
    pub fn unreachable(&self) -> Vec<String> {
        self.versions
            .iter()
            .filter(|r| r.result.is_err())
            .map(|r| r.url.clone())
            .collect()
    }
}

impl InferenceControl {
    /// A control client for SGLang-dialect engines at `urls` (`http://host:port` each), one
    /// GPU each as far as the weight-group plan is concerned (see
    /// [`InferenceControl::with_engines`]).
    pub fn new(urls: Vec<String>, admin_key: Option<String>) -> Self {
        Self::with_engines(
            urls.into_iter().map(|u| Engine::sglang(u, 1)).collect(),
            admin_key,
        )
    }

    /// A control client for `engines`, in group order.
    pub fn with_engines(engines: Vec<Engine>, admin_key: Option<String>) -> Self {
        Self::over(engines, EngineClient::new(admin_key))
    }

    /// A control client for `engines` calling through `client` (to share its connection pool).
    pub fn over(engines: Vec<Engine>, client: EngineClient) -> Self {
        InferenceControl {
            engines: Arc::new(std::sync::RwLock::new(engines)),
            client,
            fleet: Arc::default(),
        }
    }

    /// The typed engine client these calls go through (for calls to one engine).
    pub fn client(&self) -> &EngineClient {
        &self.client
    }

    /// Which of these servers are down, held or serving, and on which weight version: shared
    /// by the serving watcher (which updates it) and the weight sync (which reads it).
    pub fn fleet(&self) -> &Arc<super::fleet::Fleet> {
        &self.fleet
    }

    /// A control client over only `urls` of these servers (same fleet, same key; its own list).
    pub fn subset(&self, urls: Vec<String>) -> InferenceControl {
        let all: std::collections::HashMap<String, Engine> = self
            .engines()
            .into_iter()
            .map(|e| (e.url.clone(), e))
            .collect();
        let engines = urls
            .into_iter()
            .map(|u| all.get(&u).cloned().unwrap_or_else(|| Engine::sglang(u, 1)))
            .collect();
        InferenceControl {
            engines: Arc::new(std::sync::RwLock::new(engines)),
            ..self.clone()
        }
    }

    /// The same servers (same list, fleet and key) with calls cut after `timeout`: for reads,
    /// which change nothing and need not wait a whole control timeout on a frozen engine.
    pub fn with_timeout(&self, timeout: std::time::Duration) -> InferenceControl {
        InferenceControl {
            client: self.client.clone().with_timeout(timeout),
            ..self.clone()
        }
    }

    /// The servers this handle controls, in group order.
    pub fn urls(&self) -> Vec<String> {
        self.engines().into_iter().map(|e| e.url).collect()
    }

    /// The servers with their GPU counts and dialects, in group order (what a weight update
    /// goes to).
    pub fn engines(&self) -> Vec<Engine> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts `new` in the slot of `old` (a lost server re-placed elsewhere); false when `old`
    /// is not one of these servers.
    pub fn replace_engine(&self, old: &str, new: Engine) -> bool {
        let mut e = self.engines.write().unwrap_or_else(|p| p.into_inner());
        match e.iter_mut().find(|e| e.url == old) {
            Some(slot) => {
                *slot = new;
                true
            }
            None => false,
        }
    }

    /// Replaces the whole list (a standalone gateway follows its registered workers).
    pub fn set_engines(&self, engines: Vec<Engine>) {
        *self.engines.write().unwrap_or_else(|p| p.into_inner()) = engines;
    }

    /// Runs `call` against every server at once; one result per server, in group order.
    pub async fn fan_out<'a, T, F, Fut>(&'a self, call: F) -> Vec<ServerResult<T>>
    where
        F: Fn(&'a EngineClient, Engine) -> Fut,
        Fut: std::future::Future<Output = Result<T, EngineCallError>>,
    {
        let calls = self.engines().into_iter().map(|e| {
            let url = e.url.clone();
            let fut = call(&self.client, e);
            async move {
                ServerResult {
                    result: fut.await.map_err(|e| e.to_string()),
                    url,
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// Runs a state-changing `call` on every server at once and waits for each up to the
    /// client's timeout: `Ok(answer)` (the call's own result, whatever it is) or `Err` when it
    /// did not answer in time. A call still unanswered then (or when this future is dropped) is
    /// not cut: the engine may yet apply it, so it stays open and goes to the fleet's
    /// reconciler (`super::reconcile`), which brings the engine to the fleet's state once it
    /// answers. Calls run in place (no task each) until then. Without a reconciler, calls are
    /// cut at the timeout.
    pub async fn fan_out_patient<T, F, Fut>(
        &self,
        op: &'static str,
        call: F,
    ) -> Vec<ServerResult<T>>
    where
        T: Send + 'static,
        F: Fn(EngineClient, Engine) -> Fut,
        Fut: std::future::Future<Output = T> + Send + 'static,
    {
        let reconciler = self.fleet.reconciler();
        let wait = self.client.timeout();
        let client = match reconciler {
            Some(_) => self.client.clone().with_timeout(STALE_PATIENCE),
            None => self.client.clone(),
        };
        let calls = self.engines().into_iter().map(|e| {
            let mut open = Open {
                call: Some(Box::pin(troupe_http::hops::carry(call(client.clone(), e.clone())))),
                engine: e,
                op,
                reconciler: reconciler.clone(),
            };
            async move {
                let answered = match open.call.as_mut() {
                    Some(c) => tokio::time::timeout(wait, c).await.ok(),
                    None => None,
                };
                let result = match answered {
                    Some(a) => {
                        open.call = None;
                        Ok(a)
                    }
                    None if open.reconciler.is_some() => Err(format!(
                        "{op}: no answer within {wait:?}; the call stays open and the engine is brought to the fleet's state once it answers"
                    )),
                    None => Err(format!("{op}: no answer within {wait:?}")),
                };
                ServerResult {
                    url: open.engine.url.clone(),
                    result,
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// `/pause_generation` on every server (calls unanswered in time stay open, see
    /// [`InferenceControl::fan_out_patient`]).
    pub async fn pause(&self, mode: PauseMode) -> Vec<ServerResult<Value>> {
        flatten(
            self.fan_out_patient("pause", move |c, e| async move { c.pause(&e, mode).await })
                .await,
        )
    }

    /// `/continue_generation` on every server (calls unanswered in time stay open, see
    /// [`InferenceControl::fan_out_patient`]).
    pub async fn resume(&self) -> Vec<ServerResult<Value>> {
        flatten(
            self.fan_out_patient("resume", |c, e| async move { c.resume(&e).await })
                .await,
        )
    }

    /// `/flush_cache` on every server.
    pub async fn flush_cache(&self) -> Vec<ServerResult<Value>> {
        self.fan_out(|c, e| async move { c.flush_cache(&e).await.map(Value::from) })
            .await
    }

    /// `/release_memory_occupation` with `tags` (e.g. `weights`, `kv_cache`) on every server.
    pub async fn release_memory(&self, tags: &[&str]) -> Vec<ServerResult<Value>> {
        self.fan_out(|c, e| async move { c.release_memory(&e, tags).await.map(Value::from) })
            .await
    }

    /// `/resume_memory_occupation` with `tags` on every server.
    pub async fn resume_memory(&self, tags: &[&str]) -> Vec<ServerResult<Value>> {
        self.fan_out(|c, e| async move { c.resume_memory(&e, tags).await.map(Value::from) })
            .await
    }

    /// `/server_info` of every server (with vLLM's weight version added: `engine_info`).
    pub async fn server_info(&self) -> Vec<ServerResult<Value>> {
        self.infos()
            .await
            .into_iter()
            .map(|r| ServerResult {
                url: r.url,
                result: r.result.map(Value::from),
            })
            .collect()
    }

    /// [`InferenceControl::server_info`], typed: what a bring-up reads once and hands to the
    /// gateway (its registration then asks no server again) and to the fleet (the version the
    /// first resume expects, [`InferenceControl::versions_of`]).
    pub async fn infos(&self) -> Vec<ServerResult<ServerInfo>> {
        self.fan_out(|c, e| async move { c.engine_info(&e).await })
            .await
    }

    /// The weight versions `infos` report, as [`InferenceControl::weight_versions`] reads
    /// them: an engine whose info names none counts as not answering.
    pub fn versions_of(infos: &[ServerResult<ServerInfo>]) -> VersionCheck {
        VersionCheck {
            versions: infos
                .iter()
                .map(|r| ServerResult {
                    url: r.url.clone(),
                    result: match &r.result {
                        Ok(i) => i
                            .weight_version
                            .clone()
                            .ok_or_else(|| "its server info names no weight version".to_string()),
                        Err(e) => Err(e.clone()),
                    },
                })
                .collect(),
        }
    }

    /// `/get_weight_version` of every server.
    pub async fn weight_versions(&self) -> VersionCheck {
        VersionCheck {
            versions: self
                .fan_out(|c, e| async move { c.weight_version(&e).await })
                .await
                .into_iter()
                .map(|r| ServerResult {
                    url: r.url,
                    result: r.result,
                })
                .collect(),
        }
    }
}

/// A catch-up reaches the engines through the same client, list and fleet as these calls.
impl ControlHandle for InferenceControl {
    fn client(&self) -> &EngineClient {
        InferenceControl::client(self)
    }

    fn engines(&self) -> Vec<Engine> {
        InferenceControl::engines(self)
    }

    fn generation(&self) -> u64 {
        self.fleet.generation()
    }
}
