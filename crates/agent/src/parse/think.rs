//! `<think>…</think>` reasoning (vLLM's and SGLang's `qwen3` and `deepseek_r1`). The template
//! may already have opened `<think>` in the prompt, so an output can start inside the
//! reasoning: everything before `</think>` is reasoning. An output with no end marker is all
//! reasoning for `deepseek_r1` (which always thinks) and, with no start marker either, all
//! content for `qwen3` (SGLang's default: a model that did not think answered).

use super::ReasoningParser;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The parser; `forced`: the model always starts by thinking.
#[derive(Debug)]
pub struct Think {
    pub forced: bool,
}

impl ReasoningParser for Think {
    fn split(&self, text: &str) -> (Option<String>, String) {
        let (opened, body) = match text.find(OPEN) {
            Some(i) if text[..i].trim().is_empty() => (true, &text[i + OPEN.len()..]),
            _ => (false, text),
        };
        match body.find(CLOSE) {
            Some(j) => (
                Some(body[..j].to_string()),
                body[j + CLOSE.len()..].to_string(),
            ),
            None if opened || self.forced => (Some(body.to_string()), String::new()),
            None => (None, text.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_splits_as_vllm_and_sglang_split_it() {
        let q = Think { forced: false };
        let d = Think { forced: true };
        let both = "<think>\nI think.\n</think>\n\nAnswer.";
        for p in [&q, &d] {
            assert_eq!(
                p.split(both),
                (Some("\nI think.\n".into()), "\n\nAnswer.".into())
            );
            assert_eq!(
                p.split("I think.\n</think>\n\nA."),
                (Some("I think.\n".into()), "\n\nA.".into())
            );
            assert_eq!(
                p.split("<think>\nunfinished"),
                (Some("\nunfinished".into()), String::new())
            );
        }
        assert_eq!(q.split("Answer only."), (None, "Answer only.".into()));
        assert_eq!(
            d.split("Answer only."),
            (Some("Answer only.".into()), String::new())
        );
    }
}
