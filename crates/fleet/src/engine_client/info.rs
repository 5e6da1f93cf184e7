//! Reading what an engine is and says: its GPU count and dialect (`describe`), its info, its
//! served weight version and whether it is paused, each in the engine's own dialect. Kept apart
//! from the operations (`mod.rs`), which change an engine.

use serde_json::Value;
use troupe_wire::answers::ServerInfo;
use troupe_wire::endpoints as ep;
use troupe_wire::sglang::GetWeightVersion;
use troupe_wire::vllm::WorldSize;
use troupe_wire::{Endpoint, WeightVersion};

use super::{EngineCallError, EngineClient, believable_gpus, typed};
use crate::engines::{Engine, EngineDialect};

impl EngineClient {
    /// What one engine is, for a gateway that was only given its URL: SGLang and the
    /// reference engine answer `GET /server_info` with `tp_size` (their GPU count); vLLM
    /// answers `GET /get_world_size`. An engine that answers but neither way counts as one
    /// SGLang GPU; an error when it does not answer at all (it may be frozen or starting: ask
    /// again later rather than remember a guess).
    pub async fn describe(&self, url: &str) -> Result<Engine, EngineCallError> {
        let info = self.server_info(url).await;
        if let Ok(info) = &info
            && let Some(tp) = info.tp_size
        {
            let pp = info.pp_size.unwrap_or(1).max(1);
            let gpus = tp.max(1).saturating_mul(pp);
            let gpus = believable_gpus(url, ep::ServerInfo::PATH, gpus)?;
            let if_match = info.resume_if_match == Some(true);
            return Ok(Engine::new(url, gpus, EngineDialect::Sglang).with_resume_if_match(if_match));
        }
        const PATH: &str = ep::GetWorldSize::PATH;
        match self.send::<ep::GetWorldSize>(url, &()).await {
            Ok(v) => {
                if let Ok(w) = typed::<WorldSize>(PATH, v) {
                    let gpus = believable_gpus(url, PATH, u64::from(w.world_size.max(1)))?;
                    return Ok(Engine::new(url, gpus, EngineDialect::Vllm));
                }
                Ok(Engine::sglang(url, 1))
            }
            Err(e @ EngineCallError::Transport { .. }) if info.is_err() => Err(e),
            Err(_) => Ok(Engine::sglang(url, 1)),
        }
    }

    /// The version of the weights the engine serves.
    pub async fn weight_version(&self, e: &Engine) -> Result<WeightVersion, EngineCallError> {
        // vLLM: `GET /weight_info`; SGLang 0.5.23 has no /get_weight_version (the reference
        // engine and slime's SGLang do) and reports the version in `GET /model_info`.
        let (path, v) = match e.dialect {
            EngineDialect::Sglang => {
                let v = match self.send::<ep::GetWeightVersion>(&e.url, &()).await {
                    Err(EngineCallError::Status { status: 404, .. }) => {
                        self.send::<ep::ModelInfo>(&e.url, &()).await?
                    }
                    r => r?,
                };
                (ep::GetWeightVersion::PATH, v)
            }
            EngineDialect::Vllm => (
                ep::WeightInfo::PATH,
                self.send::<ep::WeightInfo>(&e.url, &()).await?,
            ),
        };
        typed::<GetWeightVersion>(path, v).map(|w| w.weight_version)
    }

    /// Whether the engine says it is paused: vLLM `GET /is_paused`; engines of SGLang's
    /// dialect that report it in `GET /server_info` (`internal_states[0].paused`, the reference
    /// engine's: null or the pause mode). `Ok(None)`: the engine does not say (SGLang 0.5.23
    /// reports no paused state).
    pub async fn is_paused(&self, e: &Engine) -> Result<Option<bool>, EngineCallError> {
        match e.dialect {
            EngineDialect::Vllm => {
                let v = self.send::<ep::IsPaused>(&e.url, &()).await?;
                Ok(v.get("is_paused").and_then(Value::as_bool))
            }
            EngineDialect::Sglang => Ok(self.server_info(&e.url).await?.paused()),
        }
    }

    /// `GET /server_info`.
    pub async fn server_info(&self, url: &str) -> Result<ServerInfo, EngineCallError> {
        self.call::<ep::ServerInfo>(url, &()).await
    }

    /// What an engine says it is, for the fleet's `/server_info`: its `GET /server_info`, where
    /// SGLang and the reference engine report `weight_version`. vLLM's has no such field (its
    /// version is `GET /weight_info`'s), so for a vLLM engine it is added from there, and a
    /// client reading each engine's version the SGLang way (slime) sees vLLM's too.
    pub async fn engine_info(&self, e: &Engine) -> Result<ServerInfo, EngineCallError> {
        let mut info = self.server_info(&e.url).await?;
        if e.dialect == EngineDialect::Vllm && info.weight_version.is_none() {
            info.weight_version = Some(self.weight_version(e).await?);
        }
        Ok(info)
    }

    /// vLLM's `GET /version` (`{"version": "0.32.0"}`): `Some` only from a server that
    /// answers it that way, which Troupe's engine and gateway and SGLang do not. Asked when a
    /// server's info does not come in time: vLLM's `/server_info` took 3.6 s on a loaded
    /// 2-core machine, past registration's probe timeout.
    pub async fn vllm_version(&self, url: &str) -> Option<String> {
        self.call::<ep::Version>(url, &())
            .await
            .ok()
            .map(|v| v.version)
    }

    /// `GET /server_info`, or the older `/get_server_info` when it is missing: what a server
    /// says it is (SGLang's and the reference engine's fields, or vLLM's `vllm_config` in its
    /// development mode).
    pub async fn any_server_info(&self, url: &str) -> Result<ServerInfo, EngineCallError> {
        let info = match self.server_info(url).await {
            Err(EngineCallError::Status {
                status: 404 | 405, ..
            }) => self.call::<ep::GetServerInfo>(url, &()).await?,
            r => r?,
        };
        Ok(info)
    }
}
