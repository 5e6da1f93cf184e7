//! The gateway's agent flags (`troupe gateway --tokenizer ...`): with a tokenizer the gateway
//! serves OpenAI chat and Anthropic messages from token ids and records sessions.

use troupe_controller::serve::agent_spec::{AgentOptions, agent_spec};

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
pub fn spec(f: &AgentFlags) -> Result<Option<troupe_agent::AgentSpec>, String> {
    let o = AgentOptions {
        tokenizer: f.tokenizer.clone(),
        served_model_name: f.served_model_name.clone(),
        tool_call_parser: f.tool_call_parser.clone(),
        reasoning_parser: f.reasoning_parser.clone(),
        max_agent_sessions: f.max_agent_sessions,
        max_session_tokens: f.max_session_tokens,
        session_idle_ttl_secs: f.session_idle_ttl_secs,
    };
    agent_spec(&o, |k| format!("--{}", k.replace('_', "-")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_named_as_flags() {
        let f = AgentFlags {
            tokenizer: Some("reference".into()),
            ..Default::default()
        };
        assert_eq!(spec(&f).unwrap().map(|s| s.model), Some("tiny".into()));
        let e = spec(&AgentFlags {
            tool_call_parser: Some("hermes".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.contains("--tool-call-parser") && e.contains("need --tokenizer"),
            "{e}"
        );
    }
}
