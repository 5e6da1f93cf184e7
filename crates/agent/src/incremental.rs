//! A session's turn that continues its latest turn, rendered and tokenized from its new
//! messages alone. With a template that writes each message from that message alone
//! ([`crate::template::ChatTemplate::local`]), the text the new messages add after the
//! conversation so far is what they add after the latest reply rendered alone: the template is
//! rendered over the reply and the new messages (a window whose size does not grow with the
//! session), never over the history. The result is the text a whole render gives (the tests
//! check it against one): the same two cases as [`crate::Agent::prompt`]'s whole render — the
//! latest turn's own prompt and output run on into the render (only the rest is new), or the
//! template writes the reply its own way (what follows the reply's rendering is new).

use serde_json::{Map, Value};

use crate::Agent;
use crate::error::AgentError;
use crate::session::Latest;
use crate::shared::Shared;

impl Agent {
    /// The text `messages[b.covered..]` add after turn `b`, from a render of the reply and the
    /// new messages only; `None` when the template is not local, or the window's texts do not
    /// line up as a local template's must (the caller renders the whole conversation then).
    pub(crate) fn window_delta(
        &self,
        b: &Latest,
        messages: &Shared<Value>,
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<Option<String>, AgentError> {
        if !self.tokenizer.local(tools) || b.covered == 0 || b.covered >= messages.len() {
            return Ok(None);
        }
        let render = |m: &[Value], g: bool| self.tokenizer.render(m, tools, g, kwargs);
        // What the template writes around the messages (a tools header, say), and the
        // generation prompt it ends with.
        let (empty, asked) = self.tokenizer.frame(tools, kwargs)?;
        let (empty, asked) = (empty.as_ref(), asked.as_ref());
        let Some(generation) = asked.strip_prefix(empty) else {
            return Ok(None);
        };
        let tail;
        let window = match messages.tail_slice(b.covered - 1) {
            Some(w) => w,
            None => {
                tail = messages.tail(b.covered - 1);
                &tail[..]
            }
        };
        let reply = render(&window[..1], false)?;
        let all = render(window, true)?;
        let (Some(reply), Some(added)) = (reply.strip_prefix(empty), all.strip_prefix(&reply))
        else {
            return Ok(None);
        };
        // The whole render is the history's text, then `reply` + `added`; the latest turn's
        // prompt ended with the history's text and the generation prompt, then its output.
        if b.prompt_text.ends_with(generation) {
            let own = format!("{generation}{}", b.output_text);
            let rest = format!("{reply}{added}");
            if let Some(d) = rest.strip_prefix(&own) {
                return Ok(Some(d.to_string()));
            }
        }
        Ok(Some(added.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChatTokenizer, OutputParser, SessionStore, Turn};
    use serde_json::json;
    use troupe_engine::hf_tokenizer;

    /// The reference model's agent layer; `whole`: its template marked non-local (a comment
    /// naming `loop.`), so every turn renders the whole conversation.
    fn agent(whole: bool) -> Agent {
        let mut cfg: Value = serde_json::from_str(&hf_tokenizer::tokenizer_config_json()).unwrap();
        if whole {
            let t = format!("{}{{# loop. #}}", cfg["chat_template"].as_str().unwrap());
            cfg["chat_template"] = json!(t);
        }
        Agent {
            model: "tiny".into(),
            aliases: Vec::new(),
            tokenizer: ChatTokenizer::from_files(
                &hf_tokenizer::tokenizer_json(),
                &cfg.to_string(),
                None,
            )
            .unwrap(),
            parser: OutputParser::new("none", "reference").unwrap(),
            sessions: SessionStore::default(),
        }
    }

    #[test]
    fn a_continued_turn_renders_its_new_messages_to_what_a_whole_render_gives() {
        let (fast, whole) = (agent(false), agent(true));
        assert!(fast.tokenizer.local(None) && !whole.tokenizer.local(None));
        let (a, _) = fast.sessions.open(None, None).unwrap();
        let (b, _) = whole.sessions.open(None, None).unwrap();
        let tools = [json!({"type": "function", "function": {"name": "calc", "parameters": {}}})];
        let mut messages = vec![json!({"role": "system", "content": "be brief"})];
        // Replies as the model wrote them: one whose text the template writes the same way
        // (newline-ended), one it writes its own way (the EOS token), one tool call.
        let outputs = [
            (
                "ok\n",
                json!({"role": "assistant", "content": "ok"}),
                vec![111, 107, 10],
            ),
            (
                "yo<|eos|>",
                json!({"role": "assistant", "content": "yo"}),
                vec![121, 111, 257],
            ),
            (
                "<|tool_call|>{}",
                json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": {}}}]}),
                vec![259, 123, 125],
            ),
        ];
        let news = [
            vec![json!({"role": "user", "content": "hi"})],
            vec![
                json!({"role": "tool", "content": "5", "tool_call_id": "c"}),
                json!({"role": "user", "content": "and?"}),
            ],
            vec![json!({"role": "user", "content": "more"})],
        ];
        for round in 0..6 {
            messages.extend(news[round % 3].iter().cloned());
            for (tools, forced) in [(None, None), (Some(&tools[..]), Some("<|tool_call|>"))] {
                let p = fast
                    .prompt(Some(&a), &messages, tools, &Map::new(), forced)
                    .unwrap();
                let q = whole
                    .prompt(Some(&b), &messages, tools, &Map::new(), forced)
                    .unwrap();
                assert_eq!(
                    (&p.text, &p.ids, p.parent),
                    (&q.text, &q.ids, q.parent),
                    "round {round}"
                );
            }
            let p = fast
                .prompt(Some(&a), &messages, None, &Map::new(), None)
                .unwrap();
            if round > 0 {
                assert_eq!(
                    p.parent,
                    Some(round - 1),
                    "round {round} continues the latest turn"
                );
                let shared = Shared::from(messages.clone());
                let l = fast
                    .sessions
                    .latest(&a, &shared, None)
                    .expect("the latest turn, found");
                let d = fast.window_delta(&l, &shared, None, &Map::new()).unwrap();
                assert!(d.is_some(), "round {round} renders only its new messages");
            }
            let (text, reply, ids) = &outputs[round % 3];
            for (agent, sid) in [(&fast, &a), (&whole, &b)] {
                let turn = Turn::new(
                    format!("t{round}"),
                    messages.clone(),
                    reply.clone(),
                    (p.text.clone(), p.ids.clone()),
                    (
                        text.to_string(),
                        ids.clone(),
                        vec![-1.0; ids.len()],
                        vec![json!("v"); ids.len()],
                    ),
                    json!({"type": "stop"}),
                    json!({}),
                    p.parent,
                );
                agent.sessions.record(sid, turn).unwrap();
            }
            messages.push(reply.clone());
        }
    }
}
