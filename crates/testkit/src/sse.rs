//! Reading a server-sent-event body the way a client does, once for every test binary: the
//! engine's, the gateway's and the root package's streaming tests all take a stream's events
//! apart, and three hand-rolled parsers disagreed on what they accepted (a keep-alive comment,
//! `data:` without a space, an event cut off mid-read), and a fourth read the Responses stream's
//! named events.

use serde_json::Value;

/// The `data` of each complete event in an SSE body, in order: one string per event, its
/// `data:` lines joined by `\n` (one leading space after the colon dropped, as the SSE spec
/// says). Comments (`: keep-alive`) and events without data are skipped; an event not yet
/// ended by a blank line (a body read so far, mid-event) is not returned. Any field other than
/// `data` panics naming the line: SGLang's and OpenAI's chat streams send only data, so another
/// field there is a bug the test should see (streams with named events: [`sse_events`]).
pub fn sse_data(text: &str) -> Vec<String> {
    parse(text, false).into_iter().map(|(_, d)| d).collect()
}

/// Each complete event of an SSE body whose events are named (OpenAI's Responses stream,
/// Anthropic's messages stream): `(event, data)`, the name empty when the event has no `event:`
/// line. Read as [`sse_data`] reads, but `event:` lines are allowed; any other field panics.
pub fn sse_events(text: &str) -> Vec<(String, String)> {
    parse(text, true)
}

/// The one reader behind [`sse_data`] and [`sse_events`].
fn parse(text: &str, named: bool) -> Vec<(String, String)> {
    let mut events = Vec::new();
    let mut event = String::new();
    let mut data: Option<String> = None;
    for line in text.split_inclusive('\n') {
        let Some(line) = line.strip_suffix('\n') else {
            break; // a line still being read: its event is not complete
        };
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            let name = std::mem::take(&mut event);
            if let Some(d) = data.take() {
                events.push((name, d));
            }
        } else if line.starts_with(':') {
            continue;
        } else if let Some(d) = line.strip_prefix("data:") {
            let d = d.strip_prefix(' ').unwrap_or(d);
            match &mut data {
                Some(s) => {
                    s.push('\n');
                    s.push_str(d);
                }
                None => data = Some(d.to_string()),
            }
        } else if let Some(e) = line.strip_prefix("event:").filter(|_| named) {
            event = e.strip_prefix(' ').unwrap_or(e).to_string();
        } else {
            panic!("not an SSE data line: {line:?} in {text:?}");
        }
    }
    events
}

/// The events of a finished SGLang/OpenAI-style stream as JSON: asserts the last event is
/// `[DONE]` (a stream cut short fails here, not in the test's later counts) and that every
/// other event is JSON.
pub fn sse_json(text: &str) -> Vec<Value> {
    let mut events = sse_data(text);
    assert_eq!(
        events.pop().as_deref(),
        Some("[DONE]"),
        "stream must end with [DONE]: {text}"
    );
    events
        .iter()
        .map(|e| {
            serde_json::from_str(e).unwrap_or_else(|err| panic!("event is not JSON ({err}): {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn complete_events_only_with_comments_and_line_endings_handled() {
        let body = "data: {\"a\":1}\n\n: keep-alive\n\ndata:{\"b\":2}\r\n\r\ndata: x\ndata: y\n\ndata: [DO";
        assert_eq!(sse_data(body), ["{\"a\":1}", "{\"b\":2}", "x\ny"]);
        assert!(sse_data("data: {\"a\":1}\n").is_empty(), "not ended yet");
        assert!(sse_data("").is_empty());
    }

    #[test]
    fn a_finished_stream_is_its_json_events() {
        let body = "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        assert_eq!(sse_json(body), [json!({"a": 1}), json!({"b": 2})]);
    }

    #[test]
    #[should_panic(expected = "stream must end with [DONE]")]
    fn a_stream_cut_short_fails() {
        sse_json("data: {\"a\":1}\n\n");
    }

    #[test]
    #[should_panic(expected = "not an SSE data line")]
    fn another_field_fails_by_name() {
        sse_data("event: error\ndata: {}\n\n");
    }

    #[test]
    fn named_events_keep_their_names() {
        let body = "event: response.created\ndata: {\"a\":1}\n\n: ping\n\ndata: plain\n\nevent: cut\ndata: x";
        assert_eq!(
            sse_events(body),
            [
                ("response.created".to_string(), "{\"a\":1}".to_string()),
                (String::new(), "plain".to_string())
            ]
        );
    }

    #[test]
    #[should_panic(expected = "not an SSE data line")]
    fn named_events_still_refuse_other_fields() {
        sse_events("id: 3\ndata: {}\n\n");
    }
}
