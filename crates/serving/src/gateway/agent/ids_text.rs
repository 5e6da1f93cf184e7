//! A recorded session's token ids as the JSON text its next `/generate` begins with. A turn that
//! continues the session's latest one sends the engine that turn's prompt and output ids again,
//! then the new ones: thousands of ids by turn 100. The text of the ids already sent is kept
//! (one entry per session, taken by the turn that uses it), so a turn writes only its new ids,
//! and the cost of a turn's `/generate` body does not grow with the session.

use std::collections::HashMap;

use parking_lot::Mutex;

/// The kept ids and their text, by session.
#[derive(Debug)]
pub(crate) struct IdsText {
    kept: Mutex<HashMap<String, Kept>>,
    /// Sessions kept at most (the agent layer's open-session bound): past it the oldest
    /// entries are not told apart, and all are dropped (a turn then writes its ids whole).
    cap: usize,
}

/// Ids and the text `ids` writes them as (`1,2,3`).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// The ids.
    pub ids: Vec<u32>,
    /// Their JSON list items.
    pub text: String,
}

impl Kept {
    /// Appends `more` to the ids and their text.
    pub(crate) fn extend(&mut self, more: &[u32]) {
        self.text.reserve(more.len() * 4);
        for &id in more {
            if !self.ids.is_empty() {
                self.text.push(',');
            }
            push_u32(&mut self.text, id);
            self.ids.push(id);
        }
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

    /// `ids` and their text, reusing what `session` kept when `ids` begin with its kept ids
    /// (the entry is taken: [`IdsText::keep`] puts the turn's back).
    pub(crate) fn take(&self, session: Option<&str>, ids: &[u32]) -> Kept {
        let mut k = session
            .and_then(|s| self.kept.lock().remove(s))
            .filter(|k| ids.starts_with(&k.ids))
            .unwrap_or_default();
        let from = k.ids.len();
        k.extend(&ids[from..]);
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
        let k = t.take(Some("s"), &[1, 22, 0]);
        assert_eq!(k.text, "1,22,0");
        let mut k2 = k;
        k2.extend(&[4_000_000_000]);
        t.keep("s", k2);
        let k = t.take(Some("s"), &[1, 22, 0, 4_000_000_000, 7]);
        assert_eq!(k.text, "1,22,0,4000000000,7");
        assert_eq!(k.ids, [1, 22, 0, 4_000_000_000, 7]);
        t.keep("s", k);
        // An edited history: written whole, nothing reused.
        let k = t.take(Some("s"), &[1, 23]);
        assert_eq!(k.text, "1,23");
        assert_eq!(t.take(None, &[]).text, "");
        assert_eq!(
            serde_json::from_str::<Vec<u32>>(&format!("[{}]", t.take(None, &[5, 0, 99]).text))
                .unwrap(),
            [5, 0, 99]
        );
    }
}
