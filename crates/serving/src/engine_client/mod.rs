//! [`EngineClient`]: the one place that speaks to inference engines' control endpoints.
//!
//! Pause, resume, flush, memory, weight groups, weight updates, the weight version and server
//! info: the control plane (`crate::control_plane`: the controller, its weight sync, its gRPC
//! API and the gateway's control endpoints) calls engines through this client, with the typed
//! bodies of `troupe_wire::sglang` and `troupe_wire::vllm` in each engine's dialect, so each
//! protocol is written once. Requests carry the admin key; answers that are not 2xx are errors that name
//! the endpoint, the status and the engine's message.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use troupe_wire::PauseMode;
use troupe_wire::sglang::{
    AbortRequest, DestroyWeightsUpdateGroup, GetWeightVersion, InitWeightsUpdateGroup, MemoryTags,
    PauseGeneration, UpdateWeightsFromDistributed,
};
use troupe_wire::vllm::{
    AbortRequests, CollectiveRpc, FinishWeightUpdate, InitWeightTransferEngine, UpdateInfo,
    UpdateWeightVersion, UpdateWeights, WeightTransferInit,
};

use crate::engines::{Engine, EngineDialect};
use crate::upstream::{UpstreamClient, bearer, read_body};
use axum::body::Bytes;
use axum::http::{HeaderValue, Uri};

/// Longest a control call may take (a weight bucket waits for its whole transfer).
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

mod errors;
mod info;
mod staging;

pub use errors::{EngineCallError, Refusal, version_tag};

/// A typed client for one deployment's engines' control endpoints (any engine URL; the key is
/// the deployment's admin key). Cheap to clone: the connection pool is shared.
#[derive(Debug, Clone)]
pub struct EngineClient {
    http: UpstreamClient,
    admin_key: Option<String>,
    /// `Bearer <admin key>`, or why the key cannot be sent (every call then fails with it).
    auth: Result<Option<HeaderValue>, String>,
    timeout: Duration,
}

impl EngineClient {
    /// A client that sends `admin_key` (if any) as a bearer token, over a pool of its own.
    pub fn new(admin_key: Option<String>) -> Self {
        Self::over(UpstreamClient::new(), admin_key)
    }

    /// A client over an existing pool (the gateway's own), sending `key` (if any) as a bearer
    /// token: for callers that already hold a pool and must not open another.
    pub fn over(http: UpstreamClient, key: Option<String>) -> Self {
        EngineClient {
            http,
            auth: bearer(key.as_deref(), "the admin API key"),
            admin_key: key,
            timeout: CONTROL_TIMEOUT,
        }
    }

    /// The same client with another per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long one call may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The admin key the calls carry.
    pub fn admin_key(&self) -> Option<&str> {
        self.admin_key.as_deref()
    }

    /// Pauses generation: SGLang `POST /pause_generation {mode}`, vLLM `POST /pause?mode=`
    /// (`abort` → `abort`; `in_place` and `retract` → `keep`: requests stay and continue
    /// after resume).
    pub async fn pause(&self, e: &Engine, mode: PauseMode) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.post(&e.url, "/pause_generation", &PauseGeneration { mode })
                    .await
            }
            EngineDialect::Vllm => {
                let q = match mode {
                    PauseMode::Abort => "/pause?mode=abort",
                    PauseMode::InPlace | PauseMode::Retract => "/pause?mode=keep",
                };
                self.post(&e.url, q, &json!({})).await
            }
        }
    }

    /// Resumes generation: SGLang `POST /continue_generation`, vLLM `POST /resume`.
    pub async fn resume(&self, e: &Engine) -> Result<Value, EngineCallError> {
        let path = match e.dialect {
            EngineDialect::Sglang => "/continue_generation",
            EngineDialect::Vllm => "/resume",
        };
        self.post(&e.url, path, &json!({})).await
    }

    /// Resumes generation only if the engine holds the weight version `tag` names
    /// (`POST /continue_generation` with `If-Match: tag`, made by [`version_tag`]; for engines
    /// that honour it: [`Engine::resume_if_match`]). [`Refusal::Version`] names the version the
    /// engine holds instead; it stays paused.
    pub async fn resume_if(&self, e: &Engine, tag: &HeaderValue) -> Result<Value, Refusal> {
        const PATH: &str = "/continue_generation";
        let r = self
            .exchange(&e.url, PATH, PATH, Some(&json!({})), Some(tag))
            .await;
        r.map_err(|err| match &err {
            EngineCallError::Status {
                status: 412, body, ..
            } => serde_json::from_str::<GetWeightVersion>(body)
                .map(|w| Refusal::Version(w.weight_version))
                .unwrap_or(Refusal::Failed(err)),
            _ => Refusal::Failed(err),
        })
    }

    /// Drops the prefix cache: SGLang `POST /flush_cache`, vLLM `POST /reset_prefix_cache`.
    pub async fn flush_cache(&self, e: &Engine) -> Result<Value, EngineCallError> {
        let path = match e.dialect {
            EngineDialect::Sglang => "/flush_cache",
            EngineDialect::Vllm => "/reset_prefix_cache",
        };
        self.post(&e.url, path, &json!({})).await
    }

    /// Frees memory: SGLang `POST /release_memory_occupation {tags}`, vLLM
    /// `POST /sleep?level=1&tags=…` (vLLM 0.32's `/sleep` reads only `level` and `mode`: level 1
    /// offloads the weights and drops the KV cache whatever the tags say; the reference engine
    /// reads the tags too).
    pub async fn release_memory(
        &self,
        e: &Engine,
        tags: &[&str],
    ) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.post(&e.url, "/release_memory_occupation", &tags_body(tags))
                    .await
            }
            EngineDialect::Vllm => {
                let path = format!("/sleep?level=1{}", tags_query(tags));
                self.post_dyn(&e.url, "/sleep", &path, &json!({})).await
            }
        }
    }

    /// Takes memory back: SGLang `POST /resume_memory_occupation {tags}`, vLLM
    /// `POST /wake_up?tags=…`, or `POST /wake_up` with no tags when every tag is asked for
    /// (vLLM refuses a tag that is not asleep, so after `?tags=kv_cache` an explicit
    /// `tags=weights&tags=kv_cache` would fail and leave the server asleep).
    pub async fn resume_memory(&self, e: &Engine, tags: &[&str]) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.post(&e.url, "/resume_memory_occupation", &tags_body(tags))
                    .await
            }
            EngineDialect::Vllm => {
                let all = ["weights", "kv_cache"].iter().all(|t| tags.contains(t));
                let q = if all { String::new() } else { tags_query(tags) };
                let path = format!("/wake_up{}", q.replacen('&', "?", 1));
                self.post_dyn(&e.url, "/wake_up", &path, &json!({})).await
            }
        }
    }

    /// Joins a trainer's broadcast group: SGLang `POST /init_weights_update_group`, vLLM
    /// `POST /init_weight_transfer_engine {init_info}` (the group name is SGLang's only; the
    /// `tcp` group's `group_secret` goes in either body).
    pub async fn init_weight_group(
        &self,
        e: &Engine,
        req: &InitWeightsUpdateGroup,
    ) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => self.post(&e.url, "/init_weights_update_group", req).await,
            EngineDialect::Vllm => {
                let body = InitWeightTransferEngine {
                    init_info: WeightTransferInit {
                        master_address: req.master_address.clone(),
                        master_port: req.master_port,
                        rank_offset: req.rank_offset,
                        world_size: req.world_size,
                        group_secret: req.group_secret.clone(),
                    },
                };
                self.post(&e.url, "/init_weight_transfer_engine", &body)
                    .await
            }
        }
    }

    /// Leaves a broadcast group: SGLang `POST /destroy_weights_update_group`; vLLM has no such
    /// route (its transfer engine lives until the next init), so nothing is sent.
    pub async fn destroy_weight_group(
        &self,
        e: &Engine,
        group_name: &str,
    ) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                let req = DestroyWeightsUpdateGroup {
                    group_name: group_name.to_string(),
                };
                self.post(&e.url, "/destroy_weights_update_group", &req)
                    .await
            }
            EngineDialect::Vllm => Ok(json!({"success": true})),
        }
    }

    /// Opens a weight update: vLLM `POST /start_weight_update`; SGLang has no such phase.
    pub async fn start_weight_update(&self, e: &Engine) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => Ok(json!({"success": true})),
            EngineDialect::Vllm => self.post(&e.url, "/start_weight_update", &json!({})).await,
        }
    }

    /// Receives one bucket from the group's broadcast: SGLang
    /// `POST /update_weights_from_distributed`, vLLM `POST /update_weights {update_info}`.
    pub async fn update_weights(
        &self,
        e: &Engine,
        req: &UpdateWeightsFromDistributed,
    ) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.post(&e.url, "/update_weights_from_distributed", req)
                    .await
            }
            EngineDialect::Vllm => {
                let body = UpdateWeights {
                    update_info: UpdateInfo {
                        names: req.names.clone(),
                        dtype_names: req.dtypes.clone(),
                        shapes: req.shapes.clone(),
                        packed: req.packed,
                        stage: req.stage,
                    },
                };
                self.post(&e.url, "/update_weights", &body).await
            }
        }
    }

    /// Closes a weight update, at `version` if given: vLLM `POST /finish_weight_update`;
    /// SGLang has no such phase, so only a version is sent (`POST /update_weight_version`).
    pub async fn finish_weight_update(
        &self,
        e: &Engine,
        version: Option<&str>,
    ) -> Result<Value, EngineCallError> {
        match (e.dialect, version) {
            (EngineDialect::Sglang, None) => Ok(json!({"success": true})),
            (EngineDialect::Sglang, Some(v)) => self.set_version(e, v).await,
            (EngineDialect::Vllm, v) => {
                let body = FinishWeightUpdate {
                    weight_version: v.map(str::to_string),
                };
                self.post(&e.url, "/finish_weight_update", &body).await
            }
        }
    }

    /// Aborts requests: these ids, or every request (`None`), in the engine's dialect: SGLang
    /// `POST /abort_request {rid}` per id (or `{abort_all: true}`, with `extra` SGLang fields),
    /// vLLM `POST /abort_requests {request_ids}`. The last answer.
    pub async fn abort(
        &self,
        e: &Engine,
        ids: Option<&[String]>,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<Value, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                let bodies: Vec<AbortRequest> = match ids {
                    None => vec![AbortRequest {
                        rid: None,
                        abort_all: true,
                        rest: extra.clone(),
                    }],
                    Some(ids) => ids
                        .iter()
                        .map(|r| AbortRequest {
                            rid: Some(r.clone()),
                            abort_all: false,
                            rest: extra.clone(),
                        })
                        .collect(),
                };
                let mut last = Value::Null;
                for b in &bodies {
                    last = self.post(&e.url, "/abort_request", b).await?;
                }
                Ok(last)
            }
            EngineDialect::Vllm => {
                let body = AbortRequests {
                    request_ids: ids.map(<[String]>::to_vec).unwrap_or_default(),
                };
                self.post(&e.url, "/abort_requests", &body).await
            }
        }
    }

    /// Generates one token to prove the engine serves: `GET /health_generate` (SGLang; the
    /// reference engine in either dialect), `GET /health` for vLLM, which has no such route.
    pub async fn health_generate(&self, e: &Engine) -> Result<Value, EngineCallError> {
        let path = match e.dialect {
            EngineDialect::Sglang => "/health_generate",
            EngineDialect::Vllm => "/health",
        };
        self.call(&e.url, path, path, None::<&()>).await
    }

    /// What model the engine serves: SGLang `GET /model_info`, vLLM `GET /v1/models`.
    pub async fn model_info(&self, e: &Engine) -> Result<Value, EngineCallError> {
        let path = match e.dialect {
            EngineDialect::Sglang => "/model_info",
            EngineDialect::Vllm => "/v1/models",
        };
        self.call(&e.url, path, path, None::<&()>).await
    }

    /// Loads weights from a checkpoint every engine can read, given SGLang's body of
    /// `/update_weights_from_disk` (`model_path`, `weight_version`, ...): SGLang takes it as
    /// given; vLLM reloads in place through `POST /collective_rpc {"method": "reload_weights",
    /// "kwargs": {"weights_path": model_path}}` and then, with a `weight_version`, takes it
    /// through `POST /update_weight_version` (vLLM has no disk-load route; its reload keeps the
    /// version it had). The reference engine answers both dialects the same way.
    pub async fn load_from_disk(&self, e: &Engine, body: &Value) -> Result<Value, EngineCallError> {
        const PATH: &str = "/update_weights_from_disk";
        match e.dialect {
            EngineDialect::Sglang => self.post(&e.url, PATH, body).await,
            EngineDialect::Vllm => {
                let path = body.get("model_path").and_then(Value::as_str).ok_or(
                    EngineCallError::Transport {
                        path: PATH,
                        reason: "model_path (a string) is required".into(),
                    },
                )?;
                let r = self
                    .post(
                        &e.url,
                        "/collective_rpc",
                        &CollectiveRpc::reload_weights(path),
                    )
                    .await?;
                if let Some(v) = body.get("weight_version").and_then(Value::as_str) {
                    self.set_version(e, v).await?;
                }
                Ok(r)
            }
        }
    }

    /// Sets the version the engine reports: SGLang `POST /update_weight_version {new_version}`.
    pub async fn set_version(&self, e: &Engine, version: &str) -> Result<Value, EngineCallError> {
        let body = UpdateWeightVersion {
            new_version: version.to_string(),
        };
        self.post(&e.url, "/update_weight_version", &body).await
    }

    async fn post<B: Serialize + ?Sized>(
        &self,
        url: &str,
        path: &'static str,
        body: &B,
    ) -> Result<Value, EngineCallError> {
        self.call(url, path, path, Some(body)).await
    }

    async fn post_dyn<B: Serialize + ?Sized>(
        &self,
        url: &str,
        name: &'static str,
        path_and_query: &str,
        body: &B,
    ) -> Result<Value, EngineCallError> {
        self.call(url, name, path_and_query, Some(body)).await
    }

    /// One call to `path_and_query` (errors name it `path`): POST with a JSON body, or GET
    /// without; the JSON answer (a string when the answer is not JSON).
    async fn call<B: Serialize + ?Sized>(
        &self,
        url: &str,
        path: &'static str,
        path_and_query: &str,
        body: Option<&B>,
    ) -> Result<Value, EngineCallError> {
        self.exchange(url, path, path_and_query, body, None).await
    }

    /// [`EngineClient::call`], with an `If-Match` header when given.
    async fn exchange<B: Serialize + ?Sized>(
        &self,
        url: &str,
        path: &'static str,
        path_and_query: &str,
        body: Option<&B>,
        if_match: Option<&HeaderValue>,
    ) -> Result<Value, EngineCallError> {
        let transport = |reason: String| EngineCallError::Transport { path, reason };
        let auth = self.auth.clone().map_err(transport)?;
        let full = format!("{}{path_and_query}", url.trim_end_matches('/'));
        let uri: Uri = full
            .parse()
            .map_err(|e| transport(format!("{full:?} is not a valid URL: {e}")))?;
        let body = match body {
            Some(b) => Some(Bytes::from(serde_json::to_vec(b).map_err(|e| {
                transport(format!("the request body does not serialize: {e}"))
            })?)),
            None => None,
        };
        let call = async {
            let resp = match body {
                Some(b) => self.http.post_if(uri, b, auth.as_ref(), if_match).await,
                None => self.http.get(uri, auth.as_ref()).await,
            }?;
            let status = resp.status();
            read_body(resp).await.map(|b| (status, b))
        };
        let (status, bytes) = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| transport(format!("no answer within {:?}", self.timeout)))?
            .map_err(transport)?;
        if !status.is_success() {
            return Err(EngineCallError::Status {
                path,
                status: status.as_u16(),
                body: String::from_utf8_lossy(&bytes).into_owned(),
            });
        }
        Ok(serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())))
    }
}

/// Most GPUs one engine may report (`tp × pp`, or vLLM's world size): more is a broken or
/// hostile answer, and summing such answers overflowed the fleet's world size.
pub const MAX_ENGINE_GPUS: u64 = 1 << 16;

/// `gpus` if an engine could have that many, else why not.
fn believable_gpus(url: &str, path: &'static str, gpus: u64) -> Result<u32, EngineCallError> {
    match u32::try_from(gpus) {
        Ok(g) if u64::from(g) <= MAX_ENGINE_GPUS => Ok(g),
        _ => Err(EngineCallError::Decode {
            path,
            body: gpus.to_string(),
            reason: format!(
                "{url} reports {gpus} GPUs, more than the {MAX_ENGINE_GPUS} one engine can span"
            ),
        }),
    }
}

fn tags_body(tags: &[&str]) -> MemoryTags {
    MemoryTags {
        tags: Some(tags.iter().map(|t| t.to_string()).collect()),
    }
}

/// `&tags=a&tags=b` (vLLM repeats the query key per tag).
fn tags_query(tags: &[&str]) -> String {
    tags.iter().map(|t| format!("&tags={t}")).collect()
}

fn typed<T: DeserializeOwned>(path: &'static str, v: Value) -> Result<T, EngineCallError> {
    serde_json::from_value::<T>(v.clone()).map_err(|e| EngineCallError::Decode {
        path,
        body: v.to_string(),
        reason: e.to_string(),
    })
}
