//! A finished session's trajectory, in Troupe's shape (`{"turns": [...]}`: per turn the token
//! ids, logprobs, versions and loss mask, ready for a trainer) and in AReaL's
//! (`{"interactions": {id: {"tensor_dict", "reward", "interaction_id"}}}` with its tensor
//! encoding), so either kind of trainer reads it.

use base64::Engine as _;
use serde::Serialize;
use serde_json::{Value, json};

use crate::session::{Session, Turn};

/// Troupe's trajectory as JSON text: the session's reward and every turn. A turn's `loss_mask`
/// covers `prompt_ids` then `output_ids`: 0 for the prompt (template text, tool results, and a
/// forced tool-call prefix), 1 for what the model made. `parent`: the turn whose tokens this
/// one's prompt starts with.
///
/// Written straight from the turns (their shared prompt ids and messages read in place, the
/// mask written as it is counted), not built as a JSON value first: every turn carries its
/// whole prompt, so the answer grows with the square of the session's turns, and a value
/// tree of it cost the gateway more than all of a 120-turn session's turns together. Keys in
/// the order of the workspace's sorted JSON objects, as the value tree wrote them.
pub fn trajectory(s: &Session) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&Trajectory {
        reward: s.reward,
        session_id: &s.id,
        turns: Turns(&s.turns),
    })
}

#[derive(Serialize)]
struct Trajectory<'a> {
    reward: Option<f64>,
    session_id: &'a str,
    turns: Turns<'a>,
}

/// The turns, each serialized as it is reached.
struct Turns<'a>(&'a [Turn]);

impl Serialize for Turns<'_> {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        ser.collect_seq(self.0.iter().map(|t| TurnOut {
            finish_reason: &t.finish_reason,
            id: &t.id,
            loss_mask: Mask {
                prompt: t.prompt_ids.len(),
                output: t.output_ids.len(),
            },
            messages: &t.messages,
            meta_info: &t.meta_info,
            output_ids: &t.output_ids,
            output_logprobs: &t.output_logprobs,
            parent: t.parent,
            prompt_ids: &t.prompt_ids,
            reply: &t.reply,
            reward: t.reward,
            weight_versions: &t.weight_versions,
        }))
    }
}

#[derive(Serialize)]
struct TurnOut<'a> {
    finish_reason: &'a Value,
    id: &'a str,
    loss_mask: Mask,
    messages: &'a crate::Shared<Value>,
    meta_info: &'a Value,
    output_ids: &'a [u32],
    output_logprobs: &'a [f64],
    parent: Option<usize>,
    prompt_ids: &'a crate::Shared<u32>,
    reply: &'a Value,
    reward: Option<f64>,
    weight_versions: &'a [Value],
}

/// A loss mask: `prompt` zeros, then `output` ones.
struct Mask {
    prompt: usize,
    output: usize,
}

impl Serialize for Mask {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let zeros = std::iter::repeat_n(0u8, self.prompt);
        ser.collect_seq(zeros.chain(std::iter::repeat_n(1u8, self.output)))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SessionStore, Shared};

    /// The value tree the trajectory was built as before it was written straight from the
    /// turns: the text written now must read back as it.
    fn as_values(s: &Session) -> Value {
        let turns: Vec<Value> = s
            .turns
            .iter()
            .map(|t| {
                let mut mask = vec![0u8; t.prompt_ids.len()];
                mask.resize(t.prompt_ids.len() + t.output_ids.len(), 1);
                json!({
                    "id": t.id, "prompt_ids": t.prompt_ids, "output_ids": t.output_ids,
                    "output_logprobs": t.output_logprobs, "weight_versions": t.weight_versions,
                    "loss_mask": mask, "finish_reason": t.finish_reason,
                    "meta_info": t.meta_info, "parent": t.parent, "reward": t.reward,
                    "messages": t.messages, "reply": t.reply,
                })
            })
            .collect();
        json!({"session_id": s.id, "reward": s.reward, "turns": turns})
    }

    #[test]
    fn the_trajectory_written_from_the_turns_is_the_value_tree_byte_for_byte() {
        let store = SessionStore::default();
        let (id, _) = store.open(None, None).unwrap();
        let first_ids: Shared<u32> = vec![1, 2, 3].into();
        let first_msgs: Shared<Value> = vec![json!({"role": "user", "content": "hi"})].into();
        let t0 = Turn::new(
            "t0".into(),
            first_msgs.clone(),
            json!({"role": "assistant", "content": "yo"}),
            ("<u>hi".to_string(), first_ids.clone()),
            (
                "yo".into(),
                vec![7, 8],
                vec![-0.5, f64::NAN],
                vec![json!(3), json!("v4")],
            ),
            json!({"type": "stop"}),
            json!({"e2e_latency": 0.25}),
            None,
        );
        store.record(&id, t0).unwrap();
        // The second turn's prompt and messages share the first's chunks, as a continued turn's do.
        let t1 = Turn::new(
            "t1".into(),
            first_msgs.with(vec![
                json!({"role": "tool", "content": "\"quoted\" \u{e9}"}),
            ]),
            json!({"role": "assistant", "content": null, "tool_calls": []}),
            ("<u>hi yo <t>".to_string(), first_ids.with(vec![7, 8, 9])),
            (String::new(), vec![10], vec![-1.0], vec![json!(4)]),
            json!({"type": "length", "length": 1}),
            Value::Null,
            Some(0),
        );
        store.record(&id, t1).unwrap();
        store.set_reward(&id, Some("t1"), 0.5).unwrap();
        store.set_reward(&id, None, 1.0).unwrap();
        let s = store.take(&id).unwrap();
        let written = trajectory(&s).unwrap();
        assert_eq!(
            String::from_utf8(written.clone()).unwrap(),
            as_values(&s).to_string()
        );
        let back: Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(back["turns"][1]["prompt_ids"], json!([1, 2, 3, 7, 8, 9]));
        assert_eq!(back["turns"][1]["loss_mask"], json!([0, 0, 0, 0, 0, 0, 1]));
        assert_eq!(back["turns"][0]["output_logprobs"], json!([-0.5, null]));
    }
}
