//! One agent turn: the prompt's tokens from the chat template (or, in a session, from the turn
//! it continues), a `/generate` through the gateway's own routing (policies, retries, PD, the
//! session's engine), the output split into reasoning, content and tool calls, and, in a
//! recorded session, the turn kept with its exact tokens.

use std::sync::Arc;

use axum::http::HeaderMap;
use serde_json::{Map, Value, json};
use troupe_agent::{Agent, AgentError, Parsed, Prompt, Shared, Turn, bound};

use super::super::GatewayState;

/// What a turn asks for, in the API-neutral form both APIs are turned into.
#[derive(Debug, Default)]
pub(super) struct TurnSpec {
    /// The answer's id (`chatcmpl-…`, `msg_…`), the turn's id in the session.
    pub id: String,
    /// Messages, as the template reads them (a known history shared with its turn).
    pub messages: Shared<Value>,
    /// Tools, in OpenAI's form (`[{type: function, function: {name, parameters}}]`).
    pub tools: Vec<Value>,
    /// Whether tool calls are looked for (`tool_choice` is not `none`).
    pub parse_tools: bool,
    /// A function the request forces the model to call.
    pub forced: Option<String>,
    /// The template's extra variables (`chat_template_kwargs`).
    pub kwargs: Map<String, Value>,
    /// SGLang sampling parameters.
    pub sampling: Map<String, Value>,
    /// The recorded session, if any.
    pub session: Option<String>,
    /// The id its generation runs under, which an abort by id names ([`super::request_id`]).
    pub rid: String,
    /// (turn, count): the request's first `count` messages are known to be the session's
    /// turn `turn`'s messages, as sent (`SessionStore::known`): neither compared nor bounded
    /// again (that turn's prompt fit).
    pub known: Option<(usize, usize)>,
    /// Told when the turn starts generating (its prompt made and its room held): a stream's
    /// head, with the id to abort by, goes out then.
    pub started: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Why a finished output stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// The model ended (a stop token).
    End,
    /// A stop string matched.
    Sequence,
    /// The token budget ran out.
    Length,
    /// The engine aborted it.
    Abort,
}

/// A turn's result.
#[derive(Debug)]
pub(super) struct TurnOut {
    pub prompt_tokens: usize,
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    pub parsed: Parsed,
    pub stop: Stop,
    /// The stop string that matched.
    pub matched: Option<String>,
}

/// A turn that failed: the status and message the API's error shape carries.
#[derive(Debug)]
pub(crate) struct TurnError {
    pub status: u16,
    pub message: String,
}

impl From<AgentError> for TurnError {
    fn from(e: AgentError) -> Self {
        Self {
            status: e.status(),
            message: e.to_string(),
        }
    }
}

impl TurnError {
    pub(super) fn bad(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
        }
    }
}

/// Below this many bytes of new text a turn's prompt is made on the task that serves it: the
/// hand-off to a blocking thread costs more than rendering and tokenizing a few messages.
const INLINE_BYTES: usize = 4096;

/// A turn's prompt tokens: refused from the text's length when it cannot fit the model's
/// context (before any rendering), rendered and tokenized (on a blocking thread under the
/// gateway's CPU bound, unless the new text is small), then checked in tokens against the
/// context with room for `max_new`. The spec travels to that thread and back whole, so no
/// message is copied for it.
pub(super) async fn prompt(
    state: &Arc<GatewayState>,
    agent: &Arc<Agent>,
    spec: TurnSpec,
    forced: Option<String>,
    max_new: usize,
) -> Result<(Prompt, TurnSpec), TurnError> {
    let context = state.agent_work.context();
    let (known, from) = spec.known.map_or((None, 0), |(t, n)| (Some(t), n));
    let rest;
    let new = match spec.messages.tail_slice(from) {
        Some(s) => s,
        None => {
            rest = spec.messages.tail(from);
            &rest[..]
        }
    };
    let bytes = new
        .iter()
        .chain(&spec.tools)
        .map(bound::text_bytes)
        .fold(0, usize::saturating_add)
        .saturating_add(forced.as_ref().map_or(0, String::len));
    bound::check_text(bytes, context, agent.tokenizer.max_token_bytes())?;
    let make = move |a: &Agent, spec: TurnSpec| {
        let tools = (!spec.tools.is_empty()).then_some(spec.tools.as_slice());
        let p = a.prompt_known(
            spec.session.as_deref(),
            &spec.messages,
            tools,
            &spec.kwargs,
            forced.as_deref(),
            known,
        );
        (p, spec)
    };
    // A known history is not rendered again with a local template (only the new messages
    // are); any other template renders it whole, off the async workers.
    let tools = (!spec.tools.is_empty()).then_some(spec.tools.as_slice());
    let small = bytes < INLINE_BYTES && (known.is_none() || agent.tokenizer.local(tools));
    let (prompt, spec) = if small {
        make(agent, spec)
    } else {
        let a = agent.clone();
        state.agent_work.cpu(move || make(&a, spec)).await?
    };
    let prompt = prompt?;
    bound::check_tokens(prompt.ids.len(), max_new, context)?;
    Ok((prompt, spec))
}

/// The request's `stop_token_ids`, each a token of the vocabulary (a bad entry is named, not
/// dropped), plus the model's end-of-sequence token.
fn stop_ids(agent: &Agent, v: Option<&Value>) -> Result<Vec<u32>, TurnError> {
    let vocab = agent.tokenizer.vocab_size();
    let mut ids = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| (n as usize) < vocab)
                    .ok_or_else(|| {
                        TurnError::bad(format!(
                            "stop_token_ids[{i}] is {x}; each must be a token id from 0 to {}",
                            vocab.saturating_sub(1)
                        ))
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(TurnError::bad(format!(
                "stop_token_ids must be a list of token ids, got {other}"
            )));
        }
    };
    if let Some(eos) = agent.tokenizer.eos_id()
        && !ids.contains(&eos)
    {
        ids.push(eos);
    }
    Ok(ids)
}

/// The engine's default `max_new_tokens` (SGLang's and the reference engine's) when a request
/// names none: what a turn is assumed to add when its room is held.
const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// Runs one turn.
pub(super) async fn run(
    state: &Arc<GatewayState>,
    agent: &Arc<Agent>,
    client: &HeaderMap,
    spec: TurnSpec,
) -> Result<TurnOut, TurnError> {
    let forced = match &spec.forced {
        Some(name) => Some(agent.parser.forced_prefix(name).ok_or_else(|| {
            TurnError::bad(format!(
                "tool_choice names {name:?}, but this model has no tool-call parser to write the call (gateway tool_call_parser is none)"
            ))
        })?),
        None => None,
    };
    let mut sampling = spec.sampling.clone();
    let stops = stop_ids(agent, sampling.get("stop_token_ids"))?;
    sampling.insert("stop_token_ids".into(), json!(stops));
    let max_new = sampling
        .get("max_new_tokens")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_MAX_NEW_TOKENS, |n| {
            usize::try_from(n).unwrap_or(usize::MAX)
        });
    let (prompt, mut spec) = prompt(state, agent, spec, forced.clone(), max_new).await?;
    // The room this turn may record is held before it generates: a turn that could not be
    // recorded costs no engine work, and concurrent turns of one session count together.
    let _held = match &spec.session {
        Some(s) => Some(
            agent
                .sessions
                .reserve(s, prompt.ids.len().saturating_add(max_new))?,
        ),
        None => None,
    };
    if spec.rid.is_empty() {
        spec.rid = format!("troupe-{}", uuid::Uuid::new_v4().simple());
    }
    if let Some(tx) = spec.started.take() {
        let _ = tx.send(());
    }
    let generated = super::generate::generate(
        state,
        spec.session.as_deref(),
        client,
        &spec.rid,
        &prompt.ids,
        &sampling,
    )
    .await?;
    let (output_ids, logprobs, versions, meta) = (
        generated.output_ids,
        generated.logprobs,
        generated.versions,
        generated.meta,
    );
    let finish = meta["finish_reason"].clone();
    let matched = finish["matched"].clone();
    let stop = match finish["type"].as_str() {
        Some("length") => Stop::Length,
        Some("abort") => Stop::Abort,
        _ if matched.is_string() => Stop::Sequence,
        _ => Stop::End,
    };
    // The stop token itself is not text.
    let text_ids = match (stop, output_ids.split_last()) {
        (Stop::End, Some((last, rest)))
            if matched.as_u64() == Some(u64::from(*last))
                || agent.tokenizer.eos_id() == Some(*last) =>
        {
            rest
        }
        _ => &output_ids[..],
    };
    let keep_special = spec.parse_tools && agent.parser.needs_special_tokens();
    let text = agent.tokenizer.decode(text_ids, !keep_special)?;
    let raw = agent.tokenizer.decode(&output_ids, false)?;
    let thinking = spec.kwargs.get("enable_thinking") != Some(&Value::Bool(false));
    let to_parse = format!("{}{text}", forced.as_deref().unwrap_or(""));
    let parse_with: &[Value] = if spec.parse_tools { &spec.tools } else { &[] };
    let parsed = agent.parser.parse(&to_parse, parse_with, thinking);
    let prompt_tokens = prompt.ids.len();
    if let Some(s) = &spec.session {
        let calls: Vec<Value> = parsed
            .tool_calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function", "function": {"name": c.name,
                       "arguments": serde_json::from_str::<Value>(&c.arguments).unwrap_or(json!({}))}})
            })
            .collect();
        let mut reply =
            json!({"role": "assistant", "content": parsed.content.clone().unwrap_or_default()});
        if !calls.is_empty() {
            reply["tool_calls"] = Value::Array(calls);
        }
        let turn = Turn::new(
            spec.id.clone(),
            spec.messages,
            reply,
            (prompt.text, prompt.ids),
            (raw, output_ids.clone(), logprobs.clone(), versions),
            finish,
            meta,
            prompt.parent,
        );
        agent.sessions.record(s, turn)?;
        // Where the router keeps the session, written when it changes: a restarted gateway
        // sends the next turn back where its prefix is cached. The turn is recorded already,
        // so a failed write costs only that.
        if let Err(e) = agent
            .sessions
            .note_bindings(s, state.router.session_bindings(s))
        {
            tracing::warn!(session = s, "cannot keep the session's engine binding: {e}");
        }
    }
    Ok(TurnOut {
        prompt_tokens,
        output_ids,
        logprobs,
        parsed,
        stop,
        matched: matched.as_str().map(str::to_string),
    })
}

/// OpenAI's and Anthropic's sampling fields as SGLang's sampling parameters (`max_tokens` of
/// either API, `max_completion_tokens`, `stop` / `stop_sequences`, `seed`, ...).
pub(super) fn sampling(obj: &Map<String, Value>) -> Result<Map<String, Value>, TurnError> {
    const KEYS: &[(&str, &str)] = &[
        ("max_completion_tokens", "max_new_tokens"),
        ("max_tokens", "max_new_tokens"),
        ("min_tokens", "min_new_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("stop", "stop"),
        ("stop_sequences", "stop"),
        ("stop_token_ids", "stop_token_ids"),
        ("seed", "sampling_seed"),
        ("ignore_eos", "ignore_eos"),
    ];
    let mut sp = Map::new();
    for (from, to) in KEYS {
        if let Some(v) = obj.get(*from).filter(|v| !v.is_null())
            && !sp.contains_key(*to)
        {
            sp.insert((*to).into(), v.clone());
        }
    }
    // OpenAI allows 0 to 20; the answer carries none of them (`top_logprobs: []`), so a
    // larger count is refused rather than silently answered with nothing.
    match obj.get("top_logprobs") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64().is_some_and(|n| n <= 20) => {}
        Some(n) => {
            return Err(TurnError::bad(format!(
                "top_logprobs must be an integer from 0 to 20, got {n}"
            )));
        }
    }
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(n) => {
            return Err(TurnError::bad(format!(
                "n must be 1 here (each choice is its own turn), got {n}; send n requests"
            )));
        }
    }
    Ok(sp)
}
