//! Troupe's staged weight updates (`troupe_wire::staging`), the same in both dialects: whether an
//! engine can stage, and the commit and the abort of a staged update.

use troupe_wire::WeightVersion;
use troupe_wire::answers::Ack;
use troupe_wire::endpoints as ep;
use troupe_wire::staging::{AbortWeightUpdate, CommitWeightUpdate, Discarded};

use super::{EngineCallError, EngineClient};
use crate::engines::Engine;

impl EngineClient {
    /// Whether `e` keeps buckets sent with `stage` until a commit (its `/server_info` says
    /// `weight_staging: true`; SGLang and vLLM do not, and apply buckets as they arrive).
    pub async fn weight_staging(&self, e: &Engine) -> Result<bool, EngineCallError> {
        Ok(self.any_server_info(&e.url).await?.weight_staging == Some(true))
    }

    /// `POST /commit_weight_update`: serves every staged bucket at once, as `version`.
    pub async fn commit_weight_update(
        &self,
        e: &Engine,
        version: &WeightVersion,
    ) -> Result<Ack, EngineCallError> {
        let body = CommitWeightUpdate {
            weight_version: Some(version.to_string()),
        };
        self.call::<ep::CommitWeightUpdate>(&e.url, &body).await
    }

    /// `POST /abort_weight_update`: drops a staged update (nothing staged is not an error).
    pub async fn abort_weight_update(&self, e: &Engine) -> Result<Discarded, EngineCallError> {
        self.call::<ep::AbortWeightUpdate>(&e.url, &AbortWeightUpdate {})
            .await
    }
}
