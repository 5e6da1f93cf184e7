//! The gateway's agent flags (`troupe gateway --tokenizer ...`): with a tokenizer the gateway
//! serves OpenAI chat and Anthropic messages from token ids and records sessions.

use troupe_agent::{AgentSpec, SessionLimits, TokenizerSource};

/// Flags of the gateway's agent layer.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AgentFlags {
    /// The served model's tokenizer and chat template: a model directory (`tokenizer.json`,
    /// `tokenizer_config.json`) or `reference` (the reference engine's). With it, chat and
    /// Anthropic messages are served from token ids and sessions record trajectories.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// The model name requests must give (default: `tiny` for `reference`, else the directory
    /// as given, vLLM's default served name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tool-call parser: hermes | reference | none (default: reference for the reference
    /// tokenizer, hermes otherwise).
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Reasoning parser: qwen3 | deepseek_r1 | none (default none).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Recorded sessions open at once, at most (default 4096).
    #[arg(long)]
    pub max_agent_sessions: Option<usize>,
    /// Tokens one session may record, at most (default 1048576).
    #[arg(long)]
    pub max_session_tokens: Option<usize>,
    /// Seconds a session may sit idle before it is dropped (default 3600).
    #[arg(long)]
    pub session_idle_ttl_secs: Option<u64>,
}

/// The agent layer the flags describe (none without `--tokenizer`); the tokenizer is loaded
/// here so a bad directory is reported before the gateway starts.
pub fn spec(f: &AgentFlags) -> Result<Option<AgentSpec>, String> {
    let Some(t) = &f.tokenizer else {
        let given = f.served_model_name.is_some() || f.tool_call_parser.is_some();
        return if given {
            Err("--served-model-name and --tool-call-parser need --tokenizer (a model directory or `reference`)".into())
        } else {
            Ok(None)
        };
    };
    let (source, model, parser) = if t == "reference" {
        let files = TokenizerSource::Files {
            tokenizer_json: troupe_engine::hf_tokenizer::tokenizer_json(),
            tokenizer_config_json: troupe_engine::hf_tokenizer::tokenizer_config_json(),
        };
        (files, "tiny".to_string(), "reference")
    } else {
        (TokenizerSource::Dir(t.into()), t.clone(), "hermes")
    };
    let l = SessionLimits::default();
    let spec = AgentSpec {
        model: f.served_model_name.clone().unwrap_or(model),
        tokenizer: source,
        tool_call_parser: f.tool_call_parser.clone().unwrap_or_else(|| parser.into()),
        reasoning_parser: f.reasoning_parser.clone().unwrap_or_else(|| "none".into()),
        max_sessions: f.max_agent_sessions.unwrap_or(l.max_sessions),
        max_session_tokens: f.max_session_tokens.unwrap_or(l.max_session_tokens),
        session_idle_ttl_secs: f.session_idle_ttl_secs.unwrap_or(l.idle_ttl.as_secs()),
    };
    spec.build().map_err(|e| format!("--tokenizer {t}: {e}"))?;
    Ok(Some(spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_make_a_spec_or_say_what_is_wrong() {
        let f = AgentFlags {
            tokenizer: Some("reference".into()),
            ..Default::default()
        };
        let s = spec(&f).unwrap().unwrap();
        assert_eq!(
            (s.model.as_str(), s.tool_call_parser.as_str()),
            ("tiny", "reference")
        );
        assert_eq!(spec(&AgentFlags::default()).unwrap(), None);
        let e = spec(&AgentFlags {
            tokenizer: Some("/nonexistent".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.contains("no tokenizer.json"), "{e}");
        let e = spec(&AgentFlags {
            tool_call_parser: Some("hermes".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.contains("need --tokenizer"), "{e}");
        let bad = AgentFlags {
            tokenizer: Some("reference".into()),
            reasoning_parser: Some("x".into()),
            ..Default::default()
        };
        assert!(spec(&bad).unwrap_err().contains("unknown reasoning parser"));
        let zero = AgentFlags {
            tokenizer: Some("reference".into()),
            max_agent_sessions: Some(0),
            ..Default::default()
        };
        assert!(spec(&zero).unwrap_err().contains("must be positive"));
    }
}
