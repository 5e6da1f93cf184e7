//! A finished session's trajectory, in Troupe's shape (`{"turns": [...]}`: per turn the token
//! ids, logprobs, versions and loss mask, ready for a trainer) and in AReaL's
//! (`{"interactions": {id: {"tensor_dict", "reward", "interaction_id"}}}` with its tensor
//! encoding), so either kind of trainer reads it.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::session::{Session, Turn};

/// Troupe's trajectory: the session's reward and every turn. A turn's `loss_mask` covers
/// `prompt_ids` then `output_ids`: 0 for the prompt (template text, tool results, and a
/// forced tool-call prefix), 1 for what the model made. `parent`: the turn whose tokens this
/// one's prompt starts with.
pub fn trajectory(s: &Session) -> Value {
    let turns: Vec<Value> = s
        .turns
        .iter()
        .map(|t| {
            let mut mask = vec![0u8; t.prompt_ids.len()];
            mask.resize(t.prompt_ids.len() + t.output_ids.len(), 1);
            json!({
                "id": t.id,
                "prompt_ids": t.prompt_ids,
                "output_ids": t.output_ids,
                "output_logprobs": t.output_logprobs,
                "weight_versions": t.weight_versions,
                "loss_mask": mask,
                "finish_reason": t.finish_reason,
                "meta_info": t.meta_info,
                "parent": t.parent,
                "reward": t.reward,
                "messages": t.messages,
                "reply": t.reply,
            })
        })
        .collect();
    json!({"session_id": s.id, "reward": s.reward, "turns": turns})
}

/// Rewards to go, as AReaL discounts them: from the last turn back, `cur = cur·γ + r` (a turn
/// without a reward counts 0).
pub fn discounted(turns: &[Turn], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; turns.len()];
    let mut cur = 0.0;
    for (i, t) in turns.iter().enumerate().rev() {
        cur = cur * gamma + t.reward.unwrap_or(0.0);
        out[i] = cur;
    }
    out
}

/// One tensor in AReaL's wire form: little-endian bytes, base64, shape and torch dtype.
fn tensor(bytes: Vec<u8>, shape: &[usize], dtype: &str) -> Value {
    json!({"type": "tensor",
           "data": base64::engine::general_purpose::STANDARD.encode(bytes),
           "shape": shape, "dtype": dtype})
}

fn i64s(v: impl Iterator<Item = i64>) -> Vec<u8> {
    v.flat_map(i64::to_le_bytes).collect()
}

/// A weight version as AReaL's integer (a version that is not a number: -1).
fn version_number(v: &Value) -> i64 {
    match v {
        Value::Number(n) => n.as_i64().unwrap_or(-1),
        Value::String(s) => s.parse().unwrap_or(-1),
        _ => -1,
    }
}

/// The token row of turn `i` with its loss mask, logprobs and versions. `concat`: a turn that
/// extends its parent's tokens carries the parent's output marks (mask 1) in its prompt part.
fn row(turns: &[Turn], i: usize, concat: bool) -> (Vec<u32>, Vec<i64>, Vec<f32>, Vec<i64>) {
    let t = &turns[i];
    let (mut ids, mut mask, mut lps, mut vers) = match t.parent.filter(|_| concat) {
        Some(p) if p < i => row(turns, p, true),
        _ => (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
    };
    // The prompt's own tokens past what the parent row covers.
    let start = ids.len().min(t.prompt_ids.len());
    if ids.len() > t.prompt_ids.len() || !t.prompt_ids.has_at(0, &ids[..start]) {
        (ids, mask, lps, vers) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    }
    let from = ids.len();
    ids.extend(t.prompt_ids.tail(from));
    mask.resize(ids.len(), 0);
    lps.resize(ids.len(), 0.0);
    vers.resize(ids.len(), -1);
    ids.extend_from_slice(&t.output_ids);
    mask.resize(ids.len(), 1);
    lps.extend(t.output_logprobs.iter().map(|&l| l as f32));
    lps.resize(ids.len(), 0.0);
    vers.extend(t.weight_versions.iter().map(version_number));
    vers.resize(ids.len(), -1);
    (ids, mask, lps, vers)
}

/// AReaL's `/export_trajectories` answer, as JSON text (`style`: `individual`, every turn;
/// `concat`, the turns no other turn continues, each with its ancestors' outputs marked for the
/// loss). Text, because the interactions must stay in the order the turns were made, as AReaL
/// writes them, and the workspace's JSON objects keep their keys sorted.
pub fn areal(s: &Session, gamma: f64, concat: bool) -> String {
    let rewards = discounted(&s.turns, gamma);
    let parents: Vec<usize> = s.turns.iter().filter_map(|t| t.parent).collect();
    let mut out: Vec<String> = Vec::new();
    for (i, t) in s.turns.iter().enumerate() {
        if concat && parents.contains(&i) {
            continue;
        }
        let (ids, mask, lps, vers) = row(&s.turns, i, concat);
        let n = ids.len();
        let shape = [1, n];
        let tensors = json!({
            "input_ids": tensor(i64s(ids.iter().map(|&x| i64::from(x))), &shape, "torch.int64"),
            "loss_mask": tensor(i64s(mask.into_iter()), &shape, "torch.int64"),
            "logprobs": tensor(lps.iter().flat_map(|x| x.to_le_bytes()).collect(), &shape, "torch.float32"),
            "versions": tensor(i64s(vers.into_iter()), &shape, "torch.int64"),
            "attention_mask": tensor(vec![1u8; n], &shape, "torch.bool"),
            "rewards": tensor((rewards[i] as f32).to_le_bytes().to_vec(), &[1], "torch.float32"),
        });
        let entry = json!({"tensor_dict": tensors, "reward": rewards[i], "interaction_id": t.id});
        out.push(format!("{}:{entry}", Value::String(t.id.clone())));
    }
    format!("{{\"interactions\":{{{}}}}}", out.join(","))
}
