//! The session log's records: what each change of a session writes, and how a session is put
//! together again from them. A turn that extends an earlier one (its prompt is that turn's
//! tokens plus the new messages') leaves out what that turn holds already, so a turn's record
//! costs what is new in it, not the whole history.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use troupe_agent::{Restored, Turn};

/// The format's version, in each file's first record. 2 added [`Record::Bound`]; a file of
/// an earlier version is read as it is (it holds none), one of a later version is skipped
/// whole with a warning and left on disk, never read in part.
pub(super) const VERSION: u32 = 2;

/// One change of a session.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Record {
    /// The file's first record: the session opened.
    Open {
        /// [`VERSION`].
        v: u32,
        /// Session id.
        id: String,
        /// Its bearer key.
        key: String,
    },
    /// A turn recorded; its first `prompt_from` prompt ids, `text_from` prompt bytes and
    /// `messages_from` messages are its parent turn's prompt and output (ids, text) and its
    /// messages and reply, left out here.
    Turn {
        /// The turn, less what its parent holds.
        turn: Box<Turn>,
        #[serde(default)]
        prompt_from: usize,
        #[serde(default)]
        text_from: usize,
        #[serde(default)]
        messages_from: usize,
    },
    /// A reward given.
    Reward {
        /// The turn's id, or none for the session.
        interaction: Option<String>,
        /// The reward.
        reward: f64,
    },
    /// The session ended.
    End,
    /// The router keeps the session on these engines from now on ((role, worker) pairs),
    /// written when they change: a restarted gateway sends its next turn where its prefix is
    /// cached (format version 2).
    Bound {
        /// (role, worker id) pairs.
        bindings: Vec<(String, String)>,
    },
}

/// `turn`'s record, leaving out what `parent` holds.
pub(super) fn turn(turn: &Turn, parent: Option<&Turn>) -> Record {
    let (mut prompt_from, mut text_from, mut messages_from) = (0, 0, 0);
    if let Some(p) = parent {
        let (a, b) = (p.prompt_ids.len(), p.output_ids.len());
        if turn.prompt_ids.len() >= a + b
            && turn.prompt_ids.starts_with(&p.prompt_ids)
            && turn.prompt_ids.has_at(a, &p.output_ids)
        {
            prompt_from = a + b;
        }
        let t = &turn.prompt_text;
        if t.starts_with(&p.prompt_text) && t.has_at(p.prompt_text.len(), &p.output_text) {
            text_from = p.prompt_text.len() + p.output_text.len();
        }
        let m = p.messages.len();
        if turn.messages.len() > m
            && turn.messages.starts_with(&p.messages)
            && turn.messages.get(m) == Some(&p.reply)
        {
            messages_from = m + 1;
        }
    }
    let mut t = Turn::new(
        turn.id.clone(),
        turn.messages.tail(messages_from),
        turn.reply.clone(),
        (
            turn.prompt_text.tail(text_from),
            turn.prompt_ids.tail(prompt_from),
        ),
        (
            turn.output_text.clone(),
            turn.output_ids.clone(),
            turn.output_logprobs.clone(),
            turn.weight_versions.clone(),
        ),
        turn.finish_reason.clone(),
        turn.meta_info.clone(),
        turn.parent,
    );
    t.reward = turn.reward;
    Record::Turn {
        turn: Box::new(t),
        prompt_from,
        text_from,
        messages_from,
    }
}

/// Applies a record (after the first) to the session being read back; an error says what in
/// it does not fit the records before it.
pub(super) fn apply(s: &mut Restored, r: Record) -> Result<(), String> {
    match r {
        Record::Open { .. } => Err("a second open record".into()),
        Record::Turn {
            turn,
            prompt_from,
            text_from,
            messages_from,
        } => {
            let mut t = *turn;
            if prompt_from + text_from + messages_from > 0 {
                let p = t.parent.and_then(|p| s.turns.get(p)).ok_or_else(|| {
                    format!("turn {} names a parent turn not read before it", t.id)
                })?;
                let ids: Vec<u32> = p.prompt_ids.iter().chain(&p.output_ids).copied().collect();
                let text = format!("{}{}", p.prompt_text, p.output_text);
                let msgs: Vec<Value> = p.messages.iter().chain([&p.reply]).cloned().collect();
                if prompt_from > ids.len()
                    || text_from > text.len()
                    || !text.is_char_boundary(text_from)
                    || messages_from > msgs.len()
                {
                    return Err(format!(
                        "turn {} takes more of its parent turn than the parent holds",
                        t.id
                    ));
                }
                let mut prompt = ids[..prompt_from].to_vec();
                t.prompt_ids.copy_into(&mut prompt);
                t.prompt_ids = prompt.into();
                t.prompt_text = format!("{}{}", &text[..text_from], t.prompt_text).into();
                let mut m = msgs[..messages_from].to_vec();
                t.messages.copy_into(&mut m);
                t.messages = m.into();
                // Held as the live turn was: what it shares with its parent, shared.
                t.share_with(p);
            }
            if t.output_logprobs.len() != t.output_ids.len() {
                return Err(format!(
                    "turn {} has {} output ids but {} logprobs",
                    t.id,
                    t.output_ids.len(),
                    t.output_logprobs.len()
                ));
            }
            s.turns.push(t);
            Ok(())
        }
        Record::Reward {
            interaction,
            reward,
        } => {
            if !reward.is_finite() {
                return Err(format!("a reward of {reward}"));
            }
            s.rewards.push((interaction, reward));
            Ok(())
        }
        Record::End => {
            s.ended = true;
            Ok(())
        }
        Record::Bound { bindings } => {
            s.bindings = bindings;
            Ok(())
        }
    }
}
