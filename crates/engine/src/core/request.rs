//! Messages between the HTTP layer and the scheduler thread.

use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::model::Weights;
use crate::pd::KvHandoff;
use crate::sampling::SamplingParams;

/// What SGLang reports as `finish_reason.matched`.
#[derive(Debug, Clone, PartialEq)]
pub enum Matched {
    /// A stop token id (EOS or one of `stop_token_ids`).
    Token(u32),
    /// A stop string.
    Str(String),
}

/// Why a request finished, rendered exactly like SGLang's `meta_info.finish_reason`.
#[derive(Debug, Clone, PartialEq)]
pub enum FinishReason {
    /// Hit a stop token or string.
    Stop(Matched),
    /// Hit `max_new_tokens` (or the context limit); `length` is the number of tokens produced.
    Length(usize),
    /// Aborted (by `/abort_request`, `pause_generation` in abort mode, or an error).
    Abort(String),
}

impl FinishReason {
    /// SGLang's JSON form: `{"type":"stop","matched":...}`, `{"type":"length","length":n}`,
    /// `{"type":"abort","message":...}`.
    pub fn to_json(&self) -> Value {
        match self {
            Self::Stop(Matched::Token(t)) => json!({"type": "stop", "matched": t}),
            Self::Stop(Matched::Str(s)) => json!({"type": "stop", "matched": s}),
            Self::Length(n) => json!({"type": "length", "length": n}),
            Self::Abort(m) => json!({"type": "abort", "message": m}),
        }
    }

    /// OpenAI's `finish_reason` string.
    pub fn openai(&self) -> &'static str {
        match self {
            Self::Stop(_) => "stop",
            Self::Length(_) => "length",
            Self::Abort(_) => "abort",
        }
    }
}

/// How a request is served.
#[derive(Debug)]
pub enum SeqKind {
    /// Prefill and decode here.
    Regular,
    /// PD prefill: compute the KV cache and first token, park them under `room` for the
    /// decode server, answer with `finish_reason.length == 0`.
    Prefill {
        /// Bootstrap room id.
        room: u64,
    },
    /// PD decode: start from a KV cache and first token fetched from the prefill server.
    Decode(Box<KvHandoff>),
}

/// A request as the scheduler sees it (already tokenized and validated).
#[derive(Debug)]
pub struct SeqRequest {
    /// Request id (`rid`), used by `/abort_request`.
    pub rid: String,
    /// Prompt tokens.
    pub input_ids: Vec<u32>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Resolved sampling seed.
    pub seed: u64,
    /// Whether to report logprobs.
    pub return_logprob: bool,
    /// First prompt position to report an input logprob for (already resolved from
    /// SGLang's `logprob_start_len`, where -1 means "only the last prompt token").
    pub logprob_start: usize,
    /// Regular, PD prefill or PD decode.
    pub kind: SeqKind,
    /// Where progress goes; a closed receiver aborts the request.
    pub events: mpsc::UnboundedSender<SeqEvent>,
}

/// Progress of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// Prompt logprobs `[(logprob, token)]` from `logprob_start`; the first is `None`.
    InputLogprobs(Vec<(Option<f32>, u32)>),
    /// Newly generated tokens with their logprobs.
    Tokens(Vec<(u32, f32)>),
    /// The request is done.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Weight version in effect when it finished.
        weight_version: String,
        /// Prompt tokens served from the prefix cache (`meta_info.cached_tokens`).
        cached_tokens: usize,
    },
}

/// SGLang's `pause_generation` modes (defined in `troupe-wire`).
pub use troupe_wire::PauseMode;

/// Reply channel for commands that can fail with a user-facing message.
pub type Reply = oneshot::Sender<Result<String, String>>;

/// Commands to the scheduler thread; each takes effect between batches.
#[derive(Debug)]
pub enum Command {
    /// Queue a request.
    Submit(Box<SeqRequest>),
    /// Abort one request by rid, or all when `None`.
    Abort(Option<String>, oneshot::Sender<usize>),
    /// Pause generation.
    Pause(PauseMode, oneshot::Sender<usize>),
    /// vLLM's `wait` pause: stop admitting queued requests, let the running ones finish, then
    /// pause (queued ones stay queued until resume). Answered once drained; `Err` if a resume
    /// arrived first or the running requests cannot progress (weights released).
    Drain(Reply),
    /// Resume generation; with a version list (`If-Match`), only if the weight version is one
    /// of them: checked here, between batches, so no update can land between the check and the
    /// resume. `Err` carries the version held (nothing changed).
    Continue(Option<Vec<String>>, oneshot::Sender<Result<(), String>>),
    /// Flush caches (only when idle, like SGLang).
    Flush(Reply),
    /// Replace some tensors (already validated and converted) and optionally set the version.
    UpdateTensors {
        /// `(name, values)` pairs.
        tensors: Vec<(String, Vec<f32>)>,
        /// New weight version, if given.
        version: Option<String>,
        /// Reply.
        reply: Reply,
    },
    /// Keep some tensors (already validated and converted) for a later [`Command::CommitStaged`];
    /// nothing served changes.
    StageTensors {
        /// `(name, values)` pairs.
        tensors: Vec<(String, Vec<f32>)>,
        /// The version they belong to, if the sender names it per bucket.
        version: Option<String>,
        /// Reply.
        reply: Reply,
    },
    /// Swap every staged tensor in at once and serve `version` (else the staged one).
    CommitStaged {
        /// The version to serve.
        version: Option<String>,
        /// Reply.
        reply: Reply,
    },
    /// Drop a staged update (answered with how many tensors it held).
    DiscardStaged(oneshot::Sender<usize>),
    /// Replace all weights (from disk).
    ReplaceWeights {
        /// The new weights.
        weights: Box<Weights>,
        /// New weight version, if given.
        version: Option<String>,
        /// Abort in-flight requests first.
        abort_all: bool,
        /// Reply.
        reply: Reply,
    },
    /// Set the weight version label.
    SetVersion {
        /// The new label.
        version: String,
        /// Abort in-flight requests first.
        abort_all: bool,
        /// Reply.
        reply: Reply,
    },
    /// Release weights and/or KV memory.
    Release {
        /// Release weights.
        weights: bool,
        /// Release the KV cache.
        kv_cache: bool,
        /// Reply.
        reply: Reply,
    },
    /// Resume weights and/or KV memory.
    Resume {
        /// Resume weights.
        weights: bool,
        /// Resume the KV cache.
        kv_cache: bool,
        /// Reply.
        reply: Reply,
    },
    /// Stop the thread.
    Shutdown,
    /// Nothing to do but run: sent after a command applied on the caller's thread left the
    /// scheduler work (see [`Command::runs_inline`]), since its thread was waiting for a command.
    Wake,
}

impl Command {
    /// Whether this command may be applied on the caller's thread while the scheduler thread is
    /// idle (no batch running, nothing queued before it): it only flips the scheduler's flags
    /// and moves requests between its queues, so the caller saves the two thread hand-offs of a
    /// round trip (in a 512-engine fleet's pause or resume, about half of each engine's CPU).
    /// Weight and memory commands do real work and stay on the scheduler thread.
    pub(crate) fn runs_inline(&self) -> bool {
        matches!(
            self,
            Self::Abort(..) | Self::Pause(..) | Self::Drain(_) | Self::Continue(..)
        )
    }
}
