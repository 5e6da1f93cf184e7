//! Troupe's staged weight updates (`troupe_wire::staging`), the same in both dialects: whether an
//! engine can stage, and the commit and the abort of a staged update.

use serde_json::Value;
use troupe_wire::endpoints as ep;
use troupe_wire::staging::{AbortWeightUpdate, CAPABILITY, CommitWeightUpdate};

use super::{EngineCallError, EngineClient};
use crate::engines::Engine;

impl EngineClient {
    /// Whether `e` keeps buckets sent with `stage` until a commit (its `/server_info` says
    /// `weight_staging: true`; SGLang and vLLM do not, and apply buckets as they arrive).
    pub async fn weight_staging(&self, e: &Engine) -> Result<bool, EngineCallError> {
        let info = self.any_server_info(&e.url).await?;
        Ok(info.get(CAPABILITY).and_then(Value::as_bool) == Some(true))
    }

    /// `POST /commit_weight_update`: serves every staged bucket at once, as `version`.
    pub async fn commit_weight_update(
        &self,
        e: &Engine,
        version: &str,
    ) -> Result<Value, EngineCallError> {
        let body = CommitWeightUpdate {
            weight_version: Some(version.to_string()),
        };
        self.call::<ep::CommitWeightUpdate>(&e.url, &body).await
    }

    /// `POST /abort_weight_update`: drops a staged update (nothing staged is not an error).
    pub async fn abort_weight_update(&self, e: &Engine) -> Result<Value, EngineCallError> {
        self.send::<ep::AbortWeightUpdate>(&e.url, &AbortWeightUpdate {})
            .await
    }
}
