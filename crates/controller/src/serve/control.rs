//! The inference control plane: pause, resume, flush, memory, server info — sent to every
//! server directly and concurrently, never through the router (a paused router must not stand
//! between the controller and a server it needs to resume).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

/// Longest a control call may take (a weight bucket waits for its whole transfer).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

/// How `/pause_generation` treats requests in flight (defined in `troupe-wire`).
pub use troupe_wire::PauseMode;

/// One server's outcome of a fanned-out control call.
#[derive(Debug, Clone)]
pub struct ServerResult<T> {
    /// The server.
    pub url: String,
    /// What it answered, or why it failed.
    pub result: Result<T, String>,
}

/// Control-plane client for the serving heads. Clones share one server list, which changes
/// only when a lost server is re-placed elsewhere (its slot gets the new URL).
#[derive(Clone)]
pub struct InferenceControl {
    engines: Arc<std::sync::RwLock<Vec<(String, u32)>>>,
    admin_key: Option<String>,
    client: reqwest::Client,
    fleet: Arc<super::fleet::Fleet>,
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

impl InferenceControl {
    /// A control client for `urls` (`http://host:port` each), one GPU each as far as the
    /// weight-group plan is concerned (see [`InferenceControl::with_engines`]).
    pub fn new(urls: Vec<String>, admin_key: Option<String>) -> Self {
        Self::with_engines(urls.into_iter().map(|u| (u, 1)).collect(), admin_key)
    }

    /// A control client for `(url, gpu count)` engines, in group order.
    pub fn with_engines(engines: Vec<(String, u32)>, admin_key: Option<String>) -> Self {
        let client = troupe_serving::client::build().unwrap_or_default();
        InferenceControl {
            engines: Arc::new(std::sync::RwLock::new(engines)),
            admin_key,
            client,
            fleet: Arc::default(),
        }
    }

    /// Which of these servers are down, held or serving, and on which weight version: shared
    /// by the serving watcher (which updates it) and the weight sync (which reads it).
    pub fn fleet(&self) -> &Arc<super::fleet::Fleet> {
        &self.fleet
    }

    /// A control client over only `urls` of these servers (same fleet, same key; its own list).
    pub fn subset(&self, urls: Vec<String>) -> InferenceControl {
        let all = self.engines();
        let engines = urls
            .into_iter()
            .map(|u| {
                let g = all.iter().find(|(x, _)| *x == u).map_or(1, |e| e.1);
                (u, g)
            })
            .collect();
        InferenceControl {
            engines: Arc::new(std::sync::RwLock::new(engines)),
            ..self.clone()
        }
    }

    /// The servers this handle controls, in group order.
    pub fn urls(&self) -> Vec<String> {
        self.engines().into_iter().map(|(u, _)| u).collect()
    }

    /// The servers with their GPU counts, in group order (what a weight update goes to).
    pub fn engines(&self) -> Vec<(String, u32)> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts `new` in the slot of `old` (a lost server re-placed elsewhere); false when `old`
    /// is not one of these servers.
    pub fn replace_engine(&self, old: &str, new: (String, u32)) -> bool {
        let mut e = self.engines.write().unwrap_or_else(|p| p.into_inner());
        match e.iter_mut().find(|(u, _)| u == old) {
            Some(slot) => {
                *slot = new;
                true
            }
            None => false,
        }
    }

    /// POSTs `body` to one server's `path` with the admin key; the JSON answer or why not.
    pub async fn post(&self, url: &str, path: &str, body: &Value) -> Result<Value, String> {
        self.one(url, path, Some(body)).await
    }

    async fn one(&self, url: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
        let mut req = match body {
            Some(b) => self.client.post(format!("{url}{path}")).json(b),
            None => self.client.get(format!("{url}{path}")),
        }
        .timeout(CONTROL_TIMEOUT);
        if let Some(k) = &self.admin_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.map_err(|e| format!("{path}: {e}"))?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| format!("{path}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{path}: HTTP {status}: {text}"));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// Sends `path` (POST with `body`, or GET without) to every server at once.
    pub async fn fan_out(&self, path: &str, body: Option<Value>) -> Vec<ServerResult<Value>> {
        let urls = self.urls();
        let calls = urls.into_iter().map(|u| {
            let body = body.as_ref();
            async move {
                ServerResult {
                    result: self.one(&u, path, body).await,
                    url: u,
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// `/pause_generation` on every server.
    pub async fn pause(&self, mode: PauseMode) -> Vec<ServerResult<Value>> {
        self.fan_out("/pause_generation", Some(json!({ "mode": mode })))
            .await
    }

    /// `/continue_generation` on every server.
    pub async fn resume(&self) -> Vec<ServerResult<Value>> {
        self.fan_out("/continue_generation", Some(json!({}))).await
    }

    /// `/flush_cache` on every server.
    pub async fn flush_cache(&self) -> Vec<ServerResult<Value>> {
        self.fan_out("/flush_cache", Some(json!({}))).await
    }

    /// `/release_memory_occupation` with `tags` (e.g. `weights`, `kv_cache`) on every server.
    pub async fn release_memory(&self, tags: &[&str]) -> Vec<ServerResult<Value>> {
        self.fan_out("/release_memory_occupation", Some(json!({ "tags": tags })))
            .await
    }

    /// `/resume_memory_occupation` with `tags` on every server.
    pub async fn resume_memory(&self, tags: &[&str]) -> Vec<ServerResult<Value>> {
        self.fan_out("/resume_memory_occupation", Some(json!({ "tags": tags })))
            .await
    }

    /// `/server_info` of every server.
    pub async fn server_info(&self) -> Vec<ServerResult<Value>> {
        self.fan_out("/server_info", None).await
    }
}
