//! The typed bodies of vLLM's native RL control endpoints (the routes SkyRL's
//! `RemoteInferenceClient` calls): the four-phase weight transfer and the answers of
//! `/is_paused` and `/get_world_size`. Field names are vLLM's own, so a real vLLM server, the
//! reference engine and Troupe's gateway take the same bytes.

use serde::{Deserialize, Serialize};

/// `init_info` of `POST /init_weight_transfer_engine`: where rank 0 is and which ranks this
/// server takes (`rank_offset .. rank_offset + its GPUs`). One server needs both rank fields; a
/// fleet (Troupe's gateway, which assigns each server its ranks) takes them as checks, absent
/// meaning its own. vLLM's packing settings are accepted (over Troupe's `tcp` transport every
/// bucket is one framed stream either way). Unknown fields are refused by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightTransferInit {
    /// Address of the broadcast source (trainer rank 0).
    pub master_address: String,
    /// Its port.
    pub master_port: u16,
    /// This server's first rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_offset: Option<u32>,
    /// Ranks in the whole group (1 + every engine GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// Troupe's field for its `tcp` transport: the group's secret (rank 0's
    /// `WeightSender::secret()`) the server's join must prove. Absent for vLLM's own engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_secret: Option<String>,
    /// Collective backend (Troupe's field; absent: the server's own, `nccl` on vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// vLLM's packed broadcast switch.
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub packed: bool,
    /// vLLM's packing buffer size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed_buffer_size_bytes: Option<u64>,
    /// vLLM's packing buffer count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed_num_buffers: Option<u64>,
}

impl WeightTransferInit {
    /// Rank 0 at `master_address:master_port`, this server's ranks from `rank_offset` in a
    /// group of `world_size`; everything else absent.
    pub fn new(master_address: &str, master_port: u16, rank_offset: u32, world_size: u32) -> Self {
        WeightTransferInit {
            master_address: master_address.to_string(),
            master_port,
            rank_offset: Some(rank_offset),
            world_size: Some(world_size),
            group_secret: None,
            backend: None,
            packed: false,
            packed_buffer_size_bytes: None,
            packed_num_buffers: None,
        }
    }
}

/// `POST /init_weight_transfer_engine`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitWeightTransferEngine {
    /// The group to join.
    pub init_info: WeightTransferInit,
}

/// `update_info` of `POST /update_weights`: one bucket's tensors, in broadcast order. Empty
/// (or absent) lists ask a server to reuse the previous bucket's metadata, as vLLM's worker
/// does. Unknown fields are refused by name.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateInfo {
    /// Parameter names.
    #[serde(default, deserialize_with = "crate::sglang::null_as_default")]
    pub names: Vec<String>,
    /// Their torch dtype names (`bfloat16`, `float32`, `float8_e4m3fn`).
    #[serde(default, deserialize_with = "crate::sglang::null_as_default")]
    pub dtype_names: Vec<String>,
    /// Their shapes.
    #[serde(default, deserialize_with = "crate::sglang::null_as_default")]
    pub shapes: Vec<Vec<usize>>,
    /// Whether the tensors arrive packed into one flat buffer.
    #[serde(default, deserialize_with = "crate::sglang::null_as_default")]
    pub packed: bool,
    /// SkyRL's flag for how its worker extension reloads layers (accepted; named tensors
    /// load the same either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_checkpoint_format: Option<bool>,
    /// Keep the bucket beside the live weights until `/commit_weight_update` (Troupe's field,
    /// as SGLang's `stage`; absent when false). See [`crate::staging`].
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub stage: bool,
}

impl UpdateInfo {
    /// Checks that `dtype_names` and `shapes` have one entry per name, naming the list that
    /// does not.
    pub fn check(&self) -> Result<(), String> {
        for (k, n) in [
            ("dtype_names", self.dtype_names.len()),
            ("shapes", self.shapes.len()),
        ] {
            if n != self.names.len() {
                return Err(format!(
                    "update_info.{k} must have one entry per name: got {n} for {} names",
                    self.names.len()
                ));
            }
        }
        Ok(())
    }
}

/// `update_info` as vLLM takes it: one bucket, or a list indexed by worker rank (every entry
/// the same bucket where the ranks share one receiver).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum UpdateInfoArg {
    /// One bucket for every rank.
    One(UpdateInfo),
    /// One entry per rank.
    PerRank(Vec<UpdateInfo>),
}

/// Chooses the form by the JSON's shape, so a bad field is named (an untagged enum's error
/// names neither form's field).
impl<'de> Deserialize<'de> for UpdateInfoArg {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        /// One bucket, its error naming the field inside it (`[1].names: ...`).
        fn one<E: Error>(v: serde_json::Value, at: &str) -> Result<UpdateInfo, E> {
            serde_path_to_error::deserialize(v).map_err(|e| {
                let path = e.path().to_string();
                E::custom(format!("{at}{path}: {}", e.into_inner()))
            })
        }
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Array(list) => list
                .into_iter()
                .enumerate()
                .map(|(i, v)| one(v, &format!("[{i}].")))
                .collect::<Result<_, _>>()
                .map(Self::PerRank),
            v @ serde_json::Value::Object(_) => one(v, "").map(Self::One),
            other => Err(D::Error::custom(format!(
                "expected an object {{names, dtype_names, shapes}} or a list of them, got {other}"
            ))),
        }
    }
}

impl UpdateInfoArg {
    /// The one bucket every rank takes: the object, or the list's entries, which must agree.
    /// `ranks`: how many entries a server reads (a longer list's extra entries are ignored, as
    /// vLLM indexes by rank); `None`: all of them (a fleet).
    pub fn bucket(self, ranks: Option<usize>) -> Result<UpdateInfo, String> {
        let list = match self {
            UpdateInfoArg::One(i) => return Ok(i),
            UpdateInfoArg::PerRank(list) => list,
        };
        if list.is_empty() && ranks.is_none() {
            return Err("update_info is an empty list; send one bucket".into());
        }
        let n = ranks.unwrap_or(list.len()).max(1);
        if list.len() < n {
            return Err(format!(
                "update_info is a list with {} entries, but vLLM indexes it by worker rank and this server has {n} ranks; send one object or one entry per rank",
                list.len()
            ));
        }
        let mut it = list.into_iter().take(n).enumerate();
        let Some((_, first)) = it.next() else {
            return Err("update_info is an empty list; send one bucket".into());
        };
        match it.find(|(_, x)| *x != first) {
            Some((i, _)) => Err(format!(
                "update_info[{i}] differs from update_info[0]; these ranks share one receiver, so their entries must be the same bucket"
            )),
            None => Ok(first),
        }
    }
}

/// `POST /update_weights`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeights {
    /// The bucket.
    pub update_info: UpdateInfoArg,
}

/// `POST /finish_weight_update`: Troupe's optional version the server reports afterwards.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FinishWeightUpdate {
    /// The version of the weights just loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The answer of `GET /is_paused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsPaused {
    /// Whether generation is paused.
    pub is_paused: bool,
}

/// The answer of `GET /get_world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldSize {
    /// GPUs (ranks) behind the server.
    pub world_size: u32,
}

/// `POST /reset_prefix_cache`'s body: SkyRL's client sends vLLM's query flags as JSON (vLLM
/// itself reads them from the query; a server takes both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResetPrefixCache {
    /// Also drop the cache of requests still running.
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub reset_running_requests: bool,
    /// Also reset an external (connector) cache.
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub reset_external: bool,
}

/// `POST /abort_requests`: these requests, or every request when the list is empty.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortRequests {
    /// Request ids (absent or null: none).
    #[serde(default, deserialize_with = "crate::sglang::null_as_default")]
    pub request_ids: Vec<String>,
}

/// `POST /collective_rpc`: runs one worker method on every rank of a vLLM server (served only
/// with `VLLM_SERVER_DEV_MODE=1`). vLLM passes `args` and `kwargs` to the method as given; the
/// answer is `{"results": [...]}`, one entry per rank.
///
/// Read from vLLM 0.32's `vllm/entrypoints/serve/dev/rpc/api_router.py`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveRpc {
    /// The worker method (e.g. [`RELOAD_WEIGHTS`]).
    pub method: String,
    /// Positional arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<serde_json::Value>,
    /// Keyword arguments.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Seconds the call may take (vLLM's own limit; none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
}

/// The worker method that reloads every weight in place from a checkpoint directory
/// (`kwargs.weights_path`): how a vLLM server loads a trainer's checkpoint from disk, the
/// counterpart of SGLang's `/update_weights_from_disk` (vLLM 0.32:
/// `GPUModelRunner.reload_weights(weights_iterator, weights_path, is_checkpoint_format)`, also
/// what the CPU worker runs).
pub const RELOAD_WEIGHTS: &str = "reload_weights";

impl CollectiveRpc {
    /// `reload_weights` from the checkpoint at `path` (a directory of safetensors files).
    pub fn reload_weights(path: &str) -> Self {
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("weights_path".into(), serde_json::Value::from(path));
        CollectiveRpc {
            method: RELOAD_WEIGHTS.into(),
            args: Vec::new(),
            kwargs,
            timeout: None,
        }
    }
}

/// `POST /update_weight_version`: the version the server reports from now on (vLLM 0.32's
/// `rl/online/api_router.py`; SGLang's route of the same name takes the same body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightVersion {
    /// The new version label.
    pub new_version: String,
    /// Abort requests in flight first (SGLang's field; absent when false; null: false).
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub abort_all_requests: bool,
}

/// vLLM's pause modes (`POST /pause?mode=`), spelled once for the engine, the gateway and the
/// client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Requests in flight end now (finish reason `abort`).
    #[default]
    Abort,
    /// Running requests finish first; queued ones stay queued.
    Wait,
    /// Requests stay where they are and continue after `/resume`.
    Keep,
}

impl PauseMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [PauseMode; 3] = [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep];

    /// vLLM's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Wait => "wait",
            Self::Keep => "keep",
        }
    }

    /// Parses vLLM's spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// The accepted spellings, for error messages.
    pub fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

/// What a fleet of mixed engines does for vLLM's mode: `abort` aborts; `keep` and `wait` keep
/// requests in place (`wait`'s requests then finish after resume, the closest every engine
/// offers).
impl From<PauseMode> for crate::PauseMode {
    fn from(m: PauseMode) -> Self {
        match m {
            PauseMode::Abort => crate::PauseMode::Abort,
            PauseMode::Wait | PauseMode::Keep => crate::PauseMode::InPlace,
        }
    }
}

/// SGLang's mode asked of a vLLM server: `abort` aborts; `in_place` and `retract` (requests
/// stay and go on after resume) are vLLM's `keep`.
impl From<crate::PauseMode> for PauseMode {
    fn from(m: crate::PauseMode) -> Self {
        match m {
            crate::PauseMode::Abort => PauseMode::Abort,
            crate::PauseMode::InPlace | crate::PauseMode::Retract => PauseMode::Keep,
        }
    }
}

/// `POST /pause?mode=` (a query, not a body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Pause {
    /// What happens to requests in flight (vLLM's default: `abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PauseMode>,
}

/// `POST /sleep?level=&tags=` (a query, not a body).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Sleep {
    /// vLLM's sleep level (1: offload the weights, drop the KV cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<u32>,
    /// What to release (the reference engine reads them; vLLM 0.32 does not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

/// `POST /wake_up?tags=` (a query, not a body; no tags: everything).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WakeUp {
    /// What to take back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::query_string;

    #[test]
    fn queries_are_vllms() {
        assert_eq!(query_string(&Pause::default()).unwrap(), "");
        let keep = Pause {
            mode: Some(PauseMode::Keep),
        };
        assert_eq!(query_string(&keep).unwrap(), "?mode=keep");
        let s = Sleep {
            level: Some(1),
            tags: vec!["weights".into(), "kv_cache".into()],
        };
        assert_eq!(
            query_string(&s).unwrap(),
            "?level=1&tags=weights&tags=kv_cache"
        );
        assert_eq!(query_string(&WakeUp::default()).unwrap(), "");
        for m in PauseMode::ALL {
            assert_eq!(PauseMode::parse(m.as_str()), Some(m));
        }
    }

    #[test]
    fn update_info_takes_one_bucket_or_agreeing_ranks_and_names_bad_fields() {
        let one = serde_json::json!({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]});
        let a: UpdateWeights =
            serde_json::from_value(serde_json::json!({"update_info": one.clone()})).unwrap();
        let b: UpdateWeights =
            serde_json::from_value(serde_json::json!({"update_info": [one.clone(), one.clone()]}))
                .unwrap();
        let want = a.clone().update_info.bucket(None).unwrap();
        assert_eq!(b.clone().update_info.bucket(Some(2)).unwrap(), want);
        assert!(want.check().is_ok());
        assert!(
            b.update_info
                .bucket(Some(3))
                .unwrap_err()
                .contains("3 ranks")
        );
        let other =
            serde_json::json!({"names": ["v"], "dtype_names": ["bfloat16"], "shapes": [[2]]});
        let c: UpdateInfoArg = serde_json::from_value(serde_json::json!([one, other])).unwrap();
        assert!(
            c.clone().bucket(Some(1)).is_ok(),
            "a server reads its own ranks only"
        );
        assert!(c.bucket(None).unwrap_err().contains("update_info[1]"));
        let e = serde_json::from_value::<UpdateInfoArg>(serde_json::json!({"names": "w"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("names"), "{e}");
        let e = serde_json::from_value::<UpdateInfoArg>(serde_json::json!([{"nope": 1}]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[0]") && e.contains("nope"), "{e}");
        let short: UpdateInfoArg =
            serde_json::from_value(serde_json::json!({"names": ["w"], "shapes": null})).unwrap();
        let e = short.bucket(None).unwrap().check().unwrap_err();
        assert!(e.contains("dtype_names"), "{e}");
    }

    #[test]
    fn modes_map_between_dialects_and_inits_refuse_unknown_fields() {
        use crate::PauseMode as Sglang;
        assert_eq!(Sglang::from(PauseMode::Wait), Sglang::InPlace);
        assert_eq!(Sglang::from(PauseMode::Abort), Sglang::Abort);
        assert_eq!(PauseMode::from(Sglang::Retract), PauseMode::Keep);
        let i = WeightTransferInit::new("h", 1, 1, 2);
        let back: WeightTransferInit =
            serde_json::from_value(serde_json::to_value(&i).unwrap()).unwrap();
        assert_eq!(back, i);
        let e = serde_json::from_value::<WeightTransferInit>(
            serde_json::json!({"master_address": "h", "master_port": 1, "ranks": 3}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("ranks"), "{e}");
        let r: AbortRequests =
            serde_json::from_value(serde_json::json!({"request_ids": null})).unwrap();
        assert!(r.request_ids.is_empty());
    }
}
