//! One request inside the scheduler: its tokens, KV cache and stop logic.
//!
//! Prefill, the first token and every decode step go through the same three functions
//! ([`Sequence::prefill`], [`Sequence::append`], [`Sequence::decode_step`]) whatever the serving
//! mode, which is why regular and disaggregated serving agree token for token.

use crate::model::{KvCache, Weights, forward_token, log_softmax};
use crate::sampling::sample;
use crate::tokenizer::{self, EOS_TOKEN};

use super::prefix_cache::CacheLock;
use super::request::{FinishReason, Matched, SeqEvent, SeqKind, SeqRequest};

/// A request being served.
#[derive(Debug)]
pub struct Sequence {
    /// The request.
    pub req: SeqRequest,
    /// Generated tokens so far.
    pub output: Vec<u32>,
    /// KV cache; `None` before prefill and after retraction.
    pub cache: Option<KvCache>,
    /// Set once finished.
    pub finished: Option<FinishReason>,
    /// Events produced by the last step, sent by the scheduler after the (parallel) step.
    pub pending: Vec<SeqEvent>,
    /// Whether input logprobs were already reported (not repeated after a retraction).
    pub reported_input: bool,
    /// Longest prompt + output allowed (the model's context).
    pub max_context: usize,
    /// Prompt tokens whose KV came from a prefix cache (SGLang's `meta_info.cached_tokens`).
    pub cached_tokens: usize,
    /// The prefix-cache entry this request matched, held until it finishes or is retracted.
    pub cache_lock: Option<CacheLock>,
}

/// Where a prefill's first token goes.
#[derive(Debug)]
pub enum PrefillOutcome {
    /// Continue decoding here (regular, decode, or resumed after retraction).
    Continue,
    /// A PD prefill finished: hand this to the room store.
    Handoff {
        /// Room id.
        room: u64,
        /// First token and its logprob.
        first: (u32, f32),
        /// The prompt's KV cache.
        cache: KvCache,
    },
}

impl Sequence {
    /// Wraps a request; `max_context` is the model's `max_position_embeddings`.
    pub fn new(req: SeqRequest, max_context: usize) -> Self {
        Self {
            max_context,
            req,
            output: Vec::new(),
            cache: None,
            finished: None,
            pending: Vec::new(),
            reported_input: false,
            cached_tokens: 0,
            cache_lock: None,
        }
    }

    /// Every token whose KV a prefill computes (the prompt, then any output so far).
    pub fn tokens(&self) -> Vec<u32> {
        self.req
            .input_ids
            .iter()
            .chain(&self.output)
            .copied()
            .collect()
    }

    /// How much of [`Self::tokens`] a cached prefix may cover: never the last token (its
    /// logits pick the next one), and not past the first prompt position whose input logprob
    /// the request still wants (those positions need logits).
    pub fn cacheable_len(&self) -> usize {
        if matches!(self.req.kind, SeqKind::Decode(_)) {
            return 0;
        }
        let n = self.req.input_ids.len() + self.output.len();
        let mut limit = n.saturating_sub(1);
        if self.req.return_logprob && !self.reported_input {
            let start = self
                .req
                .logprob_start
                .min(self.req.input_ids.len().saturating_sub(1));
            limit = limit.min(start);
        }
        limit
    }

    /// Tokens whose KV a prefill has to compute: the prompt, plus (after a retraction) every
    /// output token.
    pub fn prefill_len(&self) -> usize {
        match &self.req.kind {
            SeqKind::Decode(_) => 0,
            _ => self.req.input_ids.len() + self.output.len(),
        }
    }

    /// KV positions this sequence holds.
    pub fn kv_tokens(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.len)
    }

    /// Builds the KV cache (or adopts a handed-over one) and produces the next token.
    /// `prefix`, when given, is the KV of the first `prefix.len` tokens (from the prefix cache,
    /// at most [`Self::cacheable_len`]); only the rest is computed.
    pub fn prefill(&mut self, w: &Weights, prefix: Option<KvCache>) -> PrefillOutcome {
        let kind = std::mem::replace(&mut self.req.kind, SeqKind::Regular);
        if let SeqKind::Decode(h) = kind {
            let h = *h;
            self.cache = Some(h.cache);
            if self.req.params.max_new_tokens == 0 {
                self.finish(FinishReason::Length(0));
            } else {
                self.append(h.first_token, h.first_logprob);
            }
            return PrefillOutcome::Continue;
        }
        let resumed = !self.output.is_empty();
        let tokens = self.tokens();
        let n = tokens.len();
        let want_input = self.req.return_logprob && !resumed && !self.reported_input;
        let start = self
            .req
            .logprob_start
            .min(self.req.input_ids.len().saturating_sub(1));
        let mut cache = prefix
            .filter(|p| p.len <= self.cacheable_len() && p.matches(&w.config))
            .unwrap_or_else(|| KvCache::new(&w.config));
        let skip = cache.len;
        let mut input_lps: Vec<(Option<f32>, u32)> = Vec::new();
        if want_input && n > 0 {
            input_lps.push((None, tokens[start]));
        }
        let mut last_logits = None;
        for (i, &t) in tokens.iter().enumerate().skip(skip) {
            let need_input = want_input && i >= start && i + 1 < self.req.input_ids.len();
            let is_last = i + 1 == n;
            let logits = forward_token(w, &mut cache, t, need_input || is_last);
            if need_input && let Some(l) = &logits {
                let next = tokens[i + 1];
                input_lps.push((Some(log_softmax(l)[next as usize]), next));
            }
            if is_last {
                last_logits = logits;
            }
        }
        if want_input {
            self.reported_input = true;
            self.pending.push(SeqEvent::InputLogprobs(input_lps));
        }
        // A PD prefill always samples the first token: the decode side decides what to keep.
        let wants_token = matches!(kind, SeqKind::Prefill { .. })
            || self.req.params.max_new_tokens > self.output.len();
        let Some(logits) = last_logits.filter(|_| wants_token) else {
            self.cache = Some(cache);
            self.finish(FinishReason::Length(self.output.len()));
            return PrefillOutcome::Continue;
        };
        let first = sample(
            &logits,
            &self.req.params,
            &self.req.input_ids,
            &self.output,
            self.req.seed,
        );
        if let SeqKind::Prefill { room } = kind {
            self.finish(FinishReason::Length(0));
            return PrefillOutcome::Handoff { room, first, cache };
        }
        self.cache = Some(cache);
        self.append(first.0, first.1);
        PrefillOutcome::Continue
    }

    /// One decode step: run the last token, sample the next.
    pub fn decode_step(&mut self, w: &Weights) {
        let (Some(cache), Some(&last)) = (self.cache.as_mut(), self.output.last()) else {
            return;
        };
        let Some(logits) = forward_token(w, cache, last, true) else {
            return;
        };
        let (t, lp) = sample(
            &logits,
            &self.req.params,
            &self.req.input_ids,
            &self.output,
            self.req.seed,
        );
        self.append(t, lp);
    }

    /// Records a generated token and checks every stop condition.
    pub fn append(&mut self, token: u32, logprob: f32) {
        self.output.push(token);
        self.pending.push(SeqEvent::Tokens(vec![(token, logprob)]));
        let p = &self.req.params;
        let n = self.output.len();
        let may_stop = n > p.min_new_tokens || n == p.max_new_tokens;
        let stop_token = may_stop
            && ((!p.ignore_eos && token == EOS_TOKEN) || p.stop_token_ids.contains(&token));
        let reason = if stop_token {
            Some(FinishReason::Stop(Matched::Token(token)))
        } else if let Some(s) = self.matched_stop_string() {
            Some(FinishReason::Stop(Matched::Str(s)))
        } else if n >= p.max_new_tokens || self.req.input_ids.len() + n >= self.max_context {
            Some(FinishReason::Length(n))
        } else {
            None
        };
        if let Some(r) = reason {
            self.finish(r);
        }
    }

    fn matched_stop_string(&self) -> Option<String> {
        let stop = &self.req.params.stop;
        if stop.is_empty() {
            return None;
        }
        let longest = stop.iter().map(String::len).max().unwrap_or(0);
        let tail_start = self.output.len().saturating_sub(longest + 4);
        let tail = tokenizer::decode(&self.output[tail_start..]);
        stop.iter().find(|s| tail.ends_with(s.as_str())).cloned()
    }

    /// Marks the sequence finished (idempotent) and queues the event.
    pub fn finish(&mut self, reason: FinishReason) {
        if self.finished.is_none() {
            self.finished = Some(reason);
        }
    }

    /// Drops the KV cache and keeps the tokens, so a later prefill recomputes it exactly.
    /// The caller releases [`Self::cache_lock`].
    pub fn retract(&mut self) {
        self.cache = None;
    }
}

/// The text SGLang returns for these output tokens: special tokens skipped, and the matched
/// stop string / stop token trimmed unless `no_stop_trim`.
pub fn output_text(output: &[u32], finish: Option<&FinishReason>, no_stop_trim: bool) -> String {
    match finish {
        Some(FinishReason::Stop(Matched::Str(s))) if !no_stop_trim => {
            let text = tokenizer::decode(output);
            match text.strip_suffix(s.as_str()) {
                Some(t) => t.to_string(),
                None => text,
            }
        }
        Some(FinishReason::Stop(Matched::Token(_))) if !no_stop_trim && !output.is_empty() => {
            tokenizer::decode(&output[..output.len() - 1])
        }
        _ => tokenizer::decode(output),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_stop_strings_and_tokens() {
        let ids = tokenizer::encode("abcSTOP");
        let f = FinishReason::Stop(Matched::Str("STOP".into()));
        assert_eq!(output_text(&ids, Some(&f), false), "abc");
        assert_eq!(output_text(&ids, Some(&f), true), "abcSTOP");
        let t = FinishReason::Stop(Matched::Token(u32::from(b'P')));
        assert_eq!(output_text(&ids, Some(&t), false), "abcSTO");
        assert_eq!(output_text(&ids, None, false), "abcSTOP");
    }
}
