//! The gateway's agent layer from its settings (`troupe gateway --tokenizer …` and the serve
//! config's `gateway.tokenizer` …): which tokenizer, which served name and parsers, which
//! session bounds. One function for both, so a flag and a YAML key mean the same.

use troupe_agent::{AgentSpec, SessionLimits, TokenizerSource};

/// The agent settings as given (all optional).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentOptions {
    /// `reference` (the reference engine's tokenizer), a model directory, or `none` (no agent
    /// layer).
    pub tokenizer: Option<String>,
    /// The model name requests give (default `troupe-tiny`, the name the reference engine lists,
    /// for `reference`, else the directory).
    pub served_model_name: Option<String>,
    /// hermes | reference | none (default: reference for `reference`, else hermes).
    pub tool_call_parser: Option<String>,
    /// qwen3 | deepseek_r1 | none (default none).
    pub reasoning_parser: Option<String>,
    /// Open sessions at most.
    pub max_agent_sessions: Option<usize>,
    /// Tokens per session at most.
    pub max_session_tokens: Option<usize>,
    /// Idle seconds before a session is dropped.
    pub session_idle_ttl_secs: Option<u64>,
    /// Where recorded sessions are kept across gateway restarts (none: in memory only).
    pub session_dir: Option<std::path::PathBuf>,
}

/// The name the reference engine lists for its default model (`troupe-<model>`, `/v1/models`):
/// the agent layer's default name with the `reference` tokenizer, so a client naming the listed
/// model reaches it.
pub const REFERENCE_MODEL: &str = "troupe-tiny";

/// The agent layer the settings describe (none without a tokenizer), its tokenizer loaded once
/// to report a bad directory or parser now. `key(name)` spells a setting as the caller's user
/// wrote it (`--tokenizer`, `gateway.tokenizer`).
pub fn agent_spec(
    o: &AgentOptions,
    key: impl Fn(&str) -> String,
) -> Result<Option<AgentSpec>, String> {
    let Some(t) = o.tokenizer.as_ref().filter(|t| *t != "none") else {
        if o.served_model_name.is_some()
            || o.tool_call_parser.is_some()
            || o.reasoning_parser.is_some()
        {
            return Err(format!(
                "{}, {} and {} need {} (a model directory or `reference`)",
                key("served_model_name"),
                key("tool_call_parser"),
                key("reasoning_parser"),
                key("tokenizer")
            ));
        }
        return Ok(None);
    };
    let (source, model, parser) = if t == "reference" {
        (reference_files()?, REFERENCE_MODEL.to_string(), "reference")
    } else {
        (TokenizerSource::Dir(t.into()), t.clone(), "hermes")
    };
    let model = o.served_model_name.clone().unwrap_or(model);
    // `tiny` was the reference tokenizer's name before it took the engine's listed one.
    let aliases = if t == "reference" && model == REFERENCE_MODEL {
        vec!["tiny".to_string()]
    } else {
        Vec::new()
    };
    let l = SessionLimits::default();
    let spec = AgentSpec {
        model,
        aliases,
        tokenizer: source,
        tool_call_parser: o.tool_call_parser.clone().unwrap_or_else(|| parser.into()),
        reasoning_parser: o.reasoning_parser.clone().unwrap_or_else(|| "none".into()),
        max_sessions: o.max_agent_sessions.unwrap_or(l.max_sessions),
        max_session_tokens: o.max_session_tokens.unwrap_or(l.max_session_tokens),
        session_idle_ttl_secs: o.session_idle_ttl_secs.unwrap_or(l.idle_ttl.as_secs()),
        session_dir: o.session_dir.clone(),
    };
    spec.build()
        .map_err(|e| format!("{} {t}: {e}", key("tokenizer")))?;
    Ok(Some(spec))
}

#[cfg(feature = "reference")]
fn reference_files() -> Result<TokenizerSource, String> {
    Ok(TokenizerSource::Files {
        tokenizer_json: troupe_engine::hf_tokenizer::tokenizer_json(),
        tokenizer_config_json: troupe_engine::hf_tokenizer::tokenizer_config_json(),
    })
}

#[cfg(not(feature = "reference"))]
fn reference_files() -> Result<TokenizerSource, String> {
    Err("this build has no reference engine (the controller's `reference` feature); name a model directory".into())
}

#[cfg(all(test, feature = "reference"))]
mod tests {
    use super::*;

    fn flag(k: &str) -> String {
        format!("--{}", k.replace('_', "-"))
    }

    #[test]
    fn settings_make_a_spec_or_say_what_is_wrong() {
        let o = AgentOptions {
            tokenizer: Some("reference".into()),
            ..Default::default()
        };
        let s = agent_spec(&o, flag).unwrap().unwrap();
        assert_eq!(
            (s.model.as_str(), s.tool_call_parser.as_str()),
            ("troupe-tiny", "reference")
        );
        assert_eq!(s.aliases, ["tiny"]);
        assert_eq!(agent_spec(&AgentOptions::default(), flag).unwrap(), None);
        let off = AgentOptions {
            tokenizer: Some("none".into()),
            ..Default::default()
        };
        assert_eq!(agent_spec(&off, flag).unwrap(), None);
        let e = agent_spec(
            &AgentOptions {
                tokenizer: Some("/nonexistent".into()),
                ..Default::default()
            },
            flag,
        )
        .unwrap_err();
        assert!(
            e.contains("--tokenizer /nonexistent") && e.contains("no tokenizer.json"),
            "{e}"
        );
        let e = agent_spec(
            &AgentOptions {
                tool_call_parser: Some("hermes".into()),
                ..Default::default()
            },
            flag,
        )
        .unwrap_err();
        assert!(e.contains("need --tokenizer"), "{e}");
        let bad = AgentOptions {
            reasoning_parser: Some("x".into()),
            ..o.clone()
        };
        assert!(
            agent_spec(&bad, flag)
                .unwrap_err()
                .contains("unknown reasoning parser")
        );
        let zero = AgentOptions {
            max_agent_sessions: Some(0),
            ..o
        };
        assert!(
            agent_spec(&zero, flag)
                .unwrap_err()
                .contains("must be positive")
        );
    }
}
