//! A recorded session's token ids as the JSON text its next `/generate` begins with. A turn that
//! continues the session's latest one sends the engine that turn's prompt and output ids again,
//! then the new ones: thousands of ids by turn 100. The text of the ids already sent is kept
//! (one entry per session, taken by the turn that uses it), so a turn writes only its new ids,
//! and the cost of a turn's `/generate` body does not grow with the session.

use std::collections::HashMap;

use parking_lot::Mutex;
use troupe_agent::Shared;

/// The kept ids and their text, by session.
#[derive(Debug)]
pub(crate) struct IdsText {
    kept: Mutex<HashMap<String, Kept>>,
    /// Sessions kept at most (the agent layer's open-session bound): past it the oldest
    /// entries are not told apart, and all are dropped (a turn then writes its ids whole).
    cap: usize,
}

/// Ids and the text `ids` writes them as (`1,2,3`): a prompt's ids (shared with it), then the
/// ids made since (the output so far).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// The prompt's ids.
    pub prompt: Shared<u32>,
    /// The ids after them.
    pub more: Vec<u32>,
    /// Their JSON list items.
    pub text: String,
}

impl Kept {
    /// How many ids.
    pub(crate) fn len(&self) -> usize {
        self.prompt.len() + self.more.len()
    }

    /// The ids, in order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().chain(&self.more).copied()
    }

    /// Appends `more` to the ids and their text.
    pub(crate) fn extend(&mut self, more: &[u32]) {
        self.write(more);
        self.more.extend_from_slice(more);
    }

    /// Appends `ids`' text.
    fn write(&mut self, ids: &[u32]) {
        self.text.reserve(ids.len() * 4);
        for &id in ids {
            if !self.text.is_empty() {
                self.text.push(',');
            }
            push_u32(&mut self.text, id);
        }
    }

    /// Whether `prompt` begins with these ids: at once (no id compared but the ones made
    /// since) when `prompt` continues the kept prompt, as a session's next turn does.
    fn begins(&self, prompt: &Shared<u32>) -> bool {
        prompt.starts_with(&self.prompt) && prompt.has_at(self.prompt.len(), &self.more)
    }
}

impl IdsText {
    /// A store for at most `cap` sessions.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            kept: Mutex::new(HashMap::new()),
            cap: cap.max(1),
        }
    }

    /// `prompt`'s ids and their text, reusing what `session` kept when `prompt` begins with
    /// its kept ids (the entry is taken: [`IdsText::keep`] puts the turn's back).
    pub(crate) fn take(&self, session: Option<&str>, prompt: &Shared<u32>) -> Kept {
        let kept = session
            .and_then(|s| self.kept.lock().remove(s))
            .filter(|k| k.begins(prompt));
        let (from, text) = kept.map_or((0, String::new()), |k| (k.len(), k.text));
        let mut k = Kept {
            prompt: prompt.clone(),
            more: Vec::new(),
            text,
        };
        match prompt.tail_slice(from) {
            Some(new) => k.write(new),
            None => k.write(&prompt.tail(from)),
        }
        k
    }

    /// Keeps `k` as `session`'s ids so far.
    pub(crate) fn keep(&self, session: &str, k: Kept) {
        let mut g = self.kept.lock();
        if g.len() >= self.cap && !g.contains_key(session) {
            g.clear();
        }
        g.insert(session.to_string(), k);
    }

    /// Forgets `session` (finished or dropped).
    pub(crate) fn forget(&self, session: &str) {
        self.kept.lock().remove(session);
    }
}

/// Writes `n` in decimal.
fn push_u32(out: &mut String, mut n: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(&buf[i..]).unwrap_or("0"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continued_sessions_ids_are_written_once() {
        let t = IdsText::new(8);
        let p1 = Shared::from(vec![1, 22, 0]);
        let k = t.take(Some("s"), &p1);
        assert_eq!(k.text, "1,22,0");
        let mut k2 = k;
        k2.extend(&[4_000_000_000]);
        t.keep("s", k2);
        // The next prompt continues the first (shared, as a session's next turn's is).
        let p2 = p1.with(vec![4_000_000_000, 7]);
        let k = t.take(Some("s"), &p2);
        assert_eq!(k.text, "1,22,0,4000000000,7");
        assert_eq!(k.ids().collect::<Vec<_>>(), [1, 22, 0, 4_000_000_000, 7]);
        t.keep("s", k);
        // The same ids, not shared: compared, and reused.
        let p3 = Shared::from(vec![1, 22, 0, 4_000_000_000, 7, 8]);
        let k = t.take(Some("s"), &p3);
        assert_eq!(k.text, "1,22,0,4000000000,7,8");
        t.keep("s", k);
        // An edited history: written whole, nothing reused.
        let k = t.take(Some("s"), &Shared::from(vec![1, 23]));
        assert_eq!(k.text, "1,23");
        assert_eq!(t.take(None, &Shared::default()).text, "");
        let k = t.take(None, &Shared::from(vec![5, 0, 99]));
        assert_eq!(
            serde_json::from_str::<Vec<u32>>(&format!("[{}]", k.text)).unwrap(),
            [5, 0, 99]
        );
    }
}
