//! A recorded turn read back as the conversation it ended: what the Responses API's
//! `previous_response_id` continues. The chain of responses is the session's own turns (each
//! keeps the messages it was given and its reply), so it lives and dies with the session.

use serde_json::Value;

use super::SessionStore;

impl SessionStore {
    /// Turn `turn_id` of session `id` as a conversation: its messages, then its reply; `None`
    /// when the session is not open or recorded no such turn.
    pub fn conversation(&self, id: &str, turn_id: &str) -> Option<Vec<Value>> {
        let g = self.inner.lock();
        let t = g
            .sessions
            .get(id)?
            .turns
            .iter()
            .rfind(|t| t.id == turn_id)?;
        Some(t.messages.iter().chain([&t.reply]).cloned().collect())
    }
}
