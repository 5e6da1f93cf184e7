//! [`EngineClient`]: the one place that speaks to inference engines' control endpoints.
//!
//! Pause, resume, flush, memory, weight groups, weight updates, the weight version and server
//! info: the controller's control plane, its weight sync and its gRPC API all call engines
//! through this client, with SGLang's typed bodies from `troupe_wire::sglang`, so the protocol
//! is written once. Requests carry the admin key; answers that are not 2xx are errors that name
//! the endpoint, the status and the engine's message.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use troupe_wire::PauseMode;
use troupe_wire::sglang::{
    DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, MemoryTags, PauseGeneration,
    UpdateWeightsFromDistributed, WeightVersion,
};

/// Longest a control call may take (a weight bucket waits for its whole transfer).
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a control call to one engine failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineCallError {
    /// The request did not get an answer (connection refused, reset, timed out).
    #[error("{path}: {reason}")]
    Transport {
        /// The endpoint.
        path: &'static str,
        /// What the transport said.
        reason: String,
    },
    /// The engine answered with a non-2xx status.
    #[error("{path}: HTTP {status}: {body}")]
    Status {
        /// The endpoint.
        path: &'static str,
        /// The HTTP status.
        status: u16,
        /// The engine's answer (its JSON error envelope, usually).
        body: String,
    },
    /// The answer was 2xx but not what the endpoint returns.
    #[error("{path}: unexpected answer {body:?}: {reason}")]
    Decode {
        /// The endpoint.
        path: &'static str,
        /// The answer.
        body: String,
        /// Why it did not parse.
        reason: String,
    },
}

/// A typed client for one deployment's engines' control endpoints (any engine URL; the key is
/// the deployment's admin key). Cheap to clone: the connection pool is shared.
#[derive(Debug, Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    admin_key: Option<String>,
    timeout: Duration,
}

impl EngineClient {
    /// A client that sends `admin_key` (if any) as a bearer token, over the pooled
    /// TCP_NODELAY client of [`crate::client::build`] (reqwest's default client if that cannot
    /// be built, which only a broken TLS backend causes).
    pub fn new(admin_key: Option<String>) -> Self {
        let http = crate::client::build().unwrap_or_else(|e| {
            tracing::warn!("pooled HTTP client unavailable ({e}); using a default one");
            reqwest::Client::default()
        });
        EngineClient {
            http,
            admin_key,
            timeout: CONTROL_TIMEOUT,
        }
    }

    /// A client over an existing pooled `http` client (the gateway's own), sending `key` (if
    /// any) as a bearer token: for callers that already hold a pool and must not open another.
    pub fn over(http: reqwest::Client, key: Option<String>) -> Self {
        EngineClient {
            http,
            admin_key: key,
            timeout: CONTROL_TIMEOUT,
        }
    }

    /// The same client with another per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The admin key the calls carry.
    pub fn admin_key(&self) -> Option<&str> {
        self.admin_key.as_deref()
    }

    /// `POST /pause_generation {mode}`.
    pub async fn pause(&self, url: &str, mode: PauseMode) -> Result<Value, EngineCallError> {
        self.post(url, "/pause_generation", &PauseGeneration { mode })
            .await
    }

    /// `POST /continue_generation`.
    pub async fn resume(&self, url: &str) -> Result<Value, EngineCallError> {
        self.post(url, "/continue_generation", &json!({})).await
    }

    /// `POST /flush_cache`.
    pub async fn flush_cache(&self, url: &str) -> Result<Value, EngineCallError> {
        self.post(url, "/flush_cache", &json!({})).await
    }

    /// `POST /release_memory_occupation {tags}`.
    pub async fn release_memory(&self, url: &str, tags: &[&str]) -> Result<Value, EngineCallError> {
        self.post(url, "/release_memory_occupation", &tags_body(tags))
            .await
    }

    /// `POST /resume_memory_occupation {tags}`.
    pub async fn resume_memory(&self, url: &str, tags: &[&str]) -> Result<Value, EngineCallError> {
        self.post(url, "/resume_memory_occupation", &tags_body(tags))
            .await
    }

    /// `POST /init_weights_update_group`: join a trainer's broadcast group.
    pub async fn init_weight_group(
        &self,
        url: &str,
        req: &InitWeightsUpdateGroup,
    ) -> Result<Value, EngineCallError> {
        self.post(url, "/init_weights_update_group", req).await
    }

    /// `POST /destroy_weights_update_group`.
    pub async fn destroy_weight_group(
        &self,
        url: &str,
        group_name: &str,
    ) -> Result<Value, EngineCallError> {
        let req = DestroyWeightsUpdateGroup {
            group_name: group_name.to_string(),
        };
        self.post(url, "/destroy_weights_update_group", &req).await
    }

    /// `POST /update_weights_from_distributed`: receive one bucket from the group's broadcast.
    pub async fn update_weights(
        &self,
        url: &str,
        req: &UpdateWeightsFromDistributed,
    ) -> Result<Value, EngineCallError> {
        self.post(url, "/update_weights_from_distributed", req)
            .await
    }

    /// `GET /get_weight_version`: the version of the weights the engine serves.
    pub async fn weight_version(&self, url: &str) -> Result<String, EngineCallError> {
        const PATH: &str = "/get_weight_version";
        let v = self.call(url, PATH, None::<&()>).await?;
        typed::<WeightVersion>(PATH, v).map(|w| w.weight_version)
    }

    /// `GET /server_info`.
    pub async fn server_info(&self, url: &str) -> Result<Value, EngineCallError> {
        self.call(url, "/server_info", None::<&()>).await
    }

    /// The server's `disaggregation_mode` as its `GET /server_info` reports it (SGLang and the
    /// reference engine: `"null"`, `"prefill"` or `"decode"`), falling back to the older
    /// `/get_server_info` when `/server_info` is missing. `Ok(None)`: the info has no such
    /// field (vLLM and other servers).
    pub async fn disaggregation_mode(&self, url: &str) -> Result<Option<Value>, EngineCallError> {
        let info = match self.server_info(url).await {
            Err(EngineCallError::Status {
                status: 404 | 405, ..
            }) => self.call(url, "/get_server_info", None::<&()>).await?,
            r => r?,
        };
        Ok(info.get("disaggregation_mode").cloned())
    }

    async fn post<B: Serialize + ?Sized>(
        &self,
        url: &str,
        path: &'static str,
        body: &B,
    ) -> Result<Value, EngineCallError> {
        self.call(url, path, Some(body)).await
    }

    /// One call: POST with a JSON body, or GET without; the JSON answer (a string when the
    /// answer is not JSON).
    async fn call<B: Serialize + ?Sized>(
        &self,
        url: &str,
        path: &'static str,
        body: Option<&B>,
    ) -> Result<Value, EngineCallError> {
        let full = format!("{}{path}", url.trim_end_matches('/'));
        let mut req = match body {
            Some(b) => self.http.post(full).json(b),
            None => self.http.get(full),
        }
        .timeout(self.timeout);
        if let Some(k) = &self.admin_key {
            req = req.bearer_auth(k);
        }
        let transport = |e: reqwest::Error| EngineCallError::Transport {
            path,
            reason: e.to_string(),
        };
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        let text = resp.text().await.map_err(transport)?;
        if !status.is_success() {
            return Err(EngineCallError::Status {
                path,
                status: status.as_u16(),
                body: text,
            });
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }
}

fn tags_body(tags: &[&str]) -> MemoryTags {
    MemoryTags {
        tags: Some(tags.iter().map(|t| t.to_string()).collect()),
    }
}

fn typed<T: DeserializeOwned>(path: &'static str, v: Value) -> Result<T, EngineCallError> {
    serde_json::from_value::<T>(v.clone()).map_err(|e| EngineCallError::Decode {
        path,
        body: v.to_string(),
        reason: e.to_string(),
    })
}
