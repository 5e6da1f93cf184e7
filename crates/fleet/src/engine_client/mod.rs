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
use serde_json::Value;
use troupe_wire::answers::{Ack, EngineModel};
use troupe_wire::endpoints::{self as ep, Empty};
use troupe_wire::routes::Carrier;
use troupe_wire::sglang::{
    AbortRequest, DestroyWeightsUpdateGroup, GetWeightVersion, InitWeightsUpdateGroup, MemoryTags,
    PauseGeneration, UpdateWeightsFromDistributed,
};
use troupe_wire::vllm::{
    self, AbortRequests, CollectiveRpc, FinishWeightUpdate, InitWeightTransferEngine, UpdateInfo,
    UpdateInfoArg, UpdateWeightVersion, UpdateWeights, WeightTransferInit,
};
use troupe_wire::{Endpoint, PauseMode, WeightVersion};

use crate::engines::{Engine, EngineDialect};
use axum::body::Bytes;
use axum::http::{HeaderValue, Method, Uri};
use troupe_http::upstream::{UpstreamClient, bearer};

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
    pub async fn pause(&self, e: &Engine, mode: PauseMode) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.call::<ep::PauseGeneration>(&e.url, &PauseGeneration { mode })
                    .await
            }
            EngineDialect::Vllm => {
                let req = vllm::Pause {
                    mode: Some(mode.into()),
                };
                self.call::<ep::Pause>(&e.url, &req).await
            }
        }
    }

    /// Resumes generation: SGLang `POST /continue_generation`, vLLM `POST /resume`.
    pub async fn resume(&self, e: &Engine) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => self.call::<ep::ContinueGeneration>(&e.url, &Empty {}).await,
            EngineDialect::Vllm => self.call::<ep::Resume>(&e.url, &Empty {}).await,
        }
    }

    /// Resumes generation only if the engine holds the weight version `tag` names
    /// (`POST /continue_generation` with `If-Match: tag`, made by [`version_tag`]; for engines
    /// that honour it: [`Engine::resume_if_match`]). [`Refusal::Version`] names the version the
    /// engine holds instead; it stays paused.
    pub async fn resume_if(&self, e: &Engine, tag: &HeaderValue) -> Result<Ack, Refusal> {
        const PATH: &str = ep::ContinueGeneration::PATH;
        let r = self
            .exchange(&e.url, PATH, PATH, Some(&Empty {}), Some(tag))
            .await
            .and_then(|v| typed::<Ack>(PATH, v));
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
    pub async fn flush_cache(&self, e: &Engine) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => self.call::<ep::FlushCache>(&e.url, &Empty {}).await,
            EngineDialect::Vllm => {
                self.call::<ep::ResetPrefixCache>(&e.url, &vllm::ResetPrefixCache::default())
                    .await
            }
        }
    }

    /// Frees memory: SGLang `POST /release_memory_occupation {tags}`, vLLM
    /// `POST /sleep?level=1&tags=…` (vLLM 0.32's `/sleep` reads only `level` and `mode`: level 1
    /// offloads the weights and drops the KV cache whatever the tags say; the reference engine
    /// reads the tags too).
    pub async fn release_memory(&self, e: &Engine, tags: &[&str]) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.call::<ep::ReleaseMemoryOccupation>(&e.url, &tags_body(tags))
                    .await
            }
            EngineDialect::Vllm => {
                let req = vllm::Sleep {
                    level: Some(1),
                    tags: owned(tags),
                };
                self.call::<ep::Sleep>(&e.url, &req).await
            }
        }
    }

    /// Takes memory back: SGLang `POST /resume_memory_occupation {tags}`, vLLM
    /// `POST /wake_up?tags=…`, or `POST /wake_up` with no tags when every tag is asked for
    /// (vLLM refuses a tag that is not asleep, so after `?tags=kv_cache` an explicit
    /// `tags=weights&tags=kv_cache` would fail and leave the server asleep).
    pub async fn resume_memory(&self, e: &Engine, tags: &[&str]) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.call::<ep::ResumeMemoryOccupation>(&e.url, &tags_body(tags))
                    .await
            }
            EngineDialect::Vllm => {
                let all = ["weights", "kv_cache"].iter().all(|t| tags.contains(t));
                let req = vllm::WakeUp {
                    tags: if all { Vec::new() } else { owned(tags) },
                };
                self.call::<ep::WakeUp>(&e.url, &req).await
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
    ) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => self.call::<ep::InitWeightsUpdateGroup>(&e.url, req).await,
            EngineDialect::Vllm => {
                let body = InitWeightTransferEngine {
                    init_info: WeightTransferInit {
                        group_secret: req.group_secret.clone(),
                        ..WeightTransferInit::new(
                            &req.master_address,
                            req.master_port,
                            req.rank_offset,
                            req.world_size,
                        )
                    },
                };
                self.call::<ep::InitWeightTransferEngine>(&e.url, &body)
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
    ) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                let req = DestroyWeightsUpdateGroup {
                    group_name: group_name.to_string(),
                };
                self.call::<ep::DestroyWeightsUpdateGroup>(&e.url, &req)
                    .await
            }
            EngineDialect::Vllm => Ok(Ack::done()),
        }
    }

    /// Opens a weight update: vLLM `POST /start_weight_update`; SGLang has no such phase.
    pub async fn start_weight_update(&self, e: &Engine) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => Ok(Ack::done()),
            EngineDialect::Vllm => self.call::<ep::StartWeightUpdate>(&e.url, &Empty {}).await,
        }
    }

    /// Receives one bucket from the group's broadcast: SGLang
    /// `POST /update_weights_from_distributed`, vLLM `POST /update_weights {update_info}`.
    pub async fn update_weights(
        &self,
        e: &Engine,
        req: &UpdateWeightsFromDistributed,
    ) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => {
                self.call::<ep::UpdateWeightsFromDistributed>(&e.url, req)
                    .await
            }
            EngineDialect::Vllm => {
                let body = UpdateWeights {
                    update_info: UpdateInfoArg::One(UpdateInfo {
                        names: req.names.clone(),
                        dtype_names: req.dtypes.clone(),
                        shapes: req.shapes.clone(),
                        packed: req.packed,
                        is_checkpoint_format: None,
                        stage: req.stage,
                    }),
                };
                self.call::<ep::UpdateWeights>(&e.url, &body).await
            }
        }
    }

    /// Closes a weight update, at `version` if given: vLLM `POST /finish_weight_update`;
    /// SGLang has no such phase, so only a version is sent (`POST /update_weight_version`).
    pub async fn finish_weight_update(
        &self,
        e: &Engine,
        version: Option<&WeightVersion>,
    ) -> Result<Ack, EngineCallError> {
        match (e.dialect, version) {
            (EngineDialect::Sglang, None) => Ok(Ack::done()),
            (EngineDialect::Sglang, Some(v)) => self.set_version(e, v).await,
            (EngineDialect::Vllm, v) => {
                let body = FinishWeightUpdate {
                    weight_version: v.map(WeightVersion::to_string),
                };
                self.call::<ep::FinishWeightUpdate>(&e.url, &body).await
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
    ) -> Result<Ack, EngineCallError> {
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
                let mut last = Ack::default();
                for b in &bodies {
                    last = self.call::<ep::AbortRequest>(&e.url, b).await?;
                }
                Ok(last)
            }
            EngineDialect::Vllm => {
                let body = AbortRequests {
                    request_ids: ids.map(<[String]>::to_vec).unwrap_or_default(),
                };
                self.call::<ep::AbortRequests>(&e.url, &body).await
            }
        }
    }

    /// Generates one token to prove the engine serves: `GET /health_generate` (SGLang; the
    /// reference engine in either dialect), `GET /health` for vLLM, which has no such route.
    pub async fn health_generate(&self, e: &Engine) -> Result<Ack, EngineCallError> {
        match e.dialect {
            EngineDialect::Sglang => self.call::<ep::HealthGenerate>(&e.url, &()).await,
            EngineDialect::Vllm => self.call::<ep::Health>(&e.url, &()).await,
        }
    }

    /// What model the engine serves: SGLang `GET /model_info`, vLLM `GET /v1/models`.
    pub async fn model_info(&self, e: &Engine) -> Result<EngineModel, EngineCallError> {
        Ok(match e.dialect {
            EngineDialect::Sglang => {
                EngineModel::Sglang(self.call::<ep::ModelInfo>(&e.url, &()).await?)
            }
            EngineDialect::Vllm => EngineModel::Vllm(self.call::<ep::Models>(&e.url, &()).await?),
        })
    }

    /// Loads weights from a checkpoint every engine can read, given SGLang's body of
    /// `/update_weights_from_disk` (`model_path`, `weight_version`, ...): SGLang takes it as
    /// given; vLLM reloads in place through `POST /collective_rpc {"method": "reload_weights",
    /// "kwargs": {"weights_path": model_path}}` and then, with a `weight_version`, takes it
    /// through `POST /update_weight_version` (vLLM has no disk-load route; its reload keeps the
    /// version it had). The reference engine answers both dialects the same way.
    pub async fn load_from_disk(&self, e: &Engine, body: &Value) -> Result<Ack, EngineCallError> {
        const PATH: &str = ep::UpdateWeightsFromDisk::PATH;
        match e.dialect {
            // As given: the engine names what is wrong with it.
            EngineDialect::Sglang => {
                let v = self.send::<ep::UpdateWeightsFromDisk>(&e.url, body).await?;
                typed(PATH, v)
            }
            EngineDialect::Vllm => {
                let path = body.get("model_path").and_then(Value::as_str).ok_or(
                    EngineCallError::Transport {
                        path: PATH,
                        reason: "model_path (a string) is required".into(),
                    },
                )?;
                let r = self
                    .call::<ep::CollectiveRpc>(&e.url, &CollectiveRpc::reload_weights(path))
                    .await?;
                if let Some(v) = body.get("weight_version").and_then(Value::as_str) {
                    let v = WeightVersion::new(v).map_err(|reason| EngineCallError::Transport {
                        path: PATH,
                        reason: format!("weight_version: {reason}"),
                    })?;
                    self.set_version(e, &v).await?;
                }
                Ok(r)
            }
        }
    }

    /// Sets the version the engine reports: SGLang `POST /update_weight_version {new_version}`.
    pub async fn set_version(
        &self,
        e: &Engine,
        version: &WeightVersion,
    ) -> Result<Ack, EngineCallError> {
        let body = UpdateWeightVersion {
            new_version: version.to_string(),
            abort_all_requests: false,
        };
        self.call::<ep::UpdateWeightVersion>(&e.url, &body).await
    }

    /// One call of endpoint `E` on the engine at `url`: `req` goes where `E` carries it (a JSON
    /// body, or the query string of a `POST {}`; nothing for a GET) and the answer is read as
    /// `E::Response`. Errors name `E`'s path.
    pub async fn call<E: Endpoint>(
        &self,
        url: &str,
        req: &E::Request,
    ) -> Result<E::Response, EngineCallError>
    where
        E::Request: Serialize,
        E::Response: DeserializeOwned,
    {
        let v = self.send::<E>(url, req).await?;
        typed::<E::Response>(E::PATH, v)
    }

    /// [`EngineClient::call`] with any body at `E`'s route, and the answer as JSON: for a body
    /// passed on as a client gave it.
    async fn send<E: Endpoint>(
        &self,
        url: &str,
        req: &(impl Serialize + ?Sized),
    ) -> Result<Value, EngineCallError> {
        let get = !E::ROUTE.takes("POST");
        match E::CARRIER {
            Carrier::Json if !get => self.exchange(url, E::PATH, E::PATH, Some(req), None).await,
            Carrier::Query => {
                let q = troupe_wire::routes::query_string(req).map_err(|reason| {
                    EngineCallError::Transport {
                        path: E::PATH,
                        reason,
                    }
                })?;
                let pq = format!("{}{q}", E::PATH);
                self.exchange(url, E::PATH, &pq, Some(&Empty {}), None)
                    .await
            }
            _ if get => {
                self.exchange(url, E::PATH, E::PATH, None::<&()>, None)
                    .await
            }
            _ => {
                self.exchange(url, E::PATH, E::PATH, Some(&Empty {}), None)
                    .await
            }
        }
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
        let json = HeaderValue::from_static("application/json");
        let call = match body {
            Some(b) => self
                .http
                .full(Method::POST, uri, b, Some(&json), auth.as_ref(), if_match),
            None => self
                .http
                .full(Method::GET, uri, Bytes::new(), None, auth.as_ref(), None),
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

fn owned(tags: &[&str]) -> Vec<String> {
    tags.iter().map(|t| t.to_string()).collect()
}

fn typed<T: DeserializeOwned>(path: &'static str, v: Value) -> Result<T, EngineCallError> {
    serde_json::from_value::<T>(v.clone()).map_err(|e| EngineCallError::Decode {
        path,
        body: v.to_string(),
        reason: e.to_string(),
    })
}
