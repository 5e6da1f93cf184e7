//! Server-sent events: splitting an upstream byte stream into whole events.
//!
//! TCP delivers SSE in arbitrary chunks; relaying chunks as they come would hand clients half
//! events and make per-event rewriting (merging prefill logprobs) impossible. [`EventSplitter`]
//! buffers bytes and yields complete events (`...\n\n`), which the gateway relays one by one.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// The terminal event of SGLang and OpenAI streams.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Incremental SSE event splitter.
#[derive(Debug, Default)]
pub struct EventSplitter {
    buf: BytesMut,
}

fn boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

impl EventSplitter {
    /// Adds bytes from upstream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete event, terminator included, if one is buffered.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let (at, len) = boundary(&self.buf)?;
        Some(self.buf.split_to(at + len).freeze())
    }

    /// Bytes of an unfinished event still buffered.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The `data:` payload of an event (multi-line data joined by `\n`), or `None` for events
/// without data (comments, keep-alives).
pub fn data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let mut out: Option<String> = None;
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            let d = d.strip_prefix(' ').unwrap_or(d);
            match &mut out {
                Some(s) => {
                    s.push('\n');
                    s.push_str(d);
                }
                None => out = Some(d.to_string()),
            }
        }
    }
    out
}

/// Whether an event is `data: [DONE]` (asked of every relayed event: most are not, and say so
/// without a copy of their data).
pub fn is_done(event: &[u8]) -> bool {
    event.windows(6).any(|w| w == b"[DONE]") && data(event).is_some_and(|d| d.trim() == "[DONE]")
}

/// An SSE event carrying `v`.
pub fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_chunking() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = EventSplitter::default();
            let mut got = Vec::new();
            for part in stream.chunks(cut) {
                s.push(part);
                while let Some(e) = s.next_event() {
                    got.push(e);
                }
            }
            assert_eq!(got.len(), 4, "chunk size {cut}");
            assert_eq!(data(&got[0]).as_deref(), Some("{\"a\":1}"));
            assert_eq!(data(&got[1]), None);
            assert_eq!(data(&got[2]).as_deref(), Some("{\"b\":2}"));
            assert!(is_done(&got[3]));
            assert_eq!(s.pending(), 0);
        }
    }
}
