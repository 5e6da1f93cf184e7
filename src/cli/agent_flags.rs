//! The gateway's agent flags (`troupe gateway --tokenizer ...`): with a tokenizer the gateway
//! serves OpenAI chat, Responses and Anthropic messages from token ids and records sessions.
//! Without `--tokenizer` the gateway asks its workers which model they serve and takes that
//! model's tokenizer where it can read it ([`discover`]); `--tokenizer none` turns it off.

use troupe_controller::serve::agent_spec::{AgentOptions, agent_spec};

/// Flags of the gateway's agent layer.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AgentFlags {
    /// The served model's tokenizer and chat template: a model directory (`tokenizer.json`,
    /// `tokenizer_config.json`), `reference` (the reference engine's) or `none` (no agent
    /// layer: chat passes through). Default: the workers' own model's, where this machine can
    /// read it (the reference engine's, or the model directory a worker reports). With it,
    /// chat, Responses and Anthropic messages are served from token ids and sessions record
    /// trajectories.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// The model name requests must give (default: the name the workers list in
    /// `/v1/models`; with `--tokenizer`, `troupe-tiny` for `reference`, else the directory as
    /// given, vLLM's default served name).
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
    /// Keep recorded sessions in this directory as they happen (one file per open session,
    /// deleted once exported), so a gateway started again with it continues them (default:
    /// in memory only).
    #[arg(long)]
    pub session_dir: Option<std::path::PathBuf>,
}

/// The agent layer the flags describe (none without `--tokenizer`); the tokenizer is loaded
/// here so a bad directory is reported before the gateway starts.
pub fn spec(f: &AgentFlags) -> Result<Option<troupe_agent::AgentSpec>, String> {
    agent_spec(&options(f), |k| format!("--{}", k.replace('_', "-")))
}

/// The agent layer of the workers' own model, for a gateway started without `--tokenizer`,
/// and the start-up line saying which tokenizer it took or why none; a bad agent flag (a
/// parser's name) is an error. The first worker that
/// answers is asked `/server_info` and `/v1/models`: the reference engine (its `version`) has
/// its tokenizer built in; SGLang's `model_path` or vLLM's model (`root`) is used when it is a
/// directory on this machine holding `tokenizer.json`. The served name is the one the worker
/// lists, so a client naming it reaches the agent layer.
pub async fn discover(
    f: &AgentFlags,
    workers: &[String],
    worker_key: Option<&str>,
) -> Result<(Option<troupe_agent::AgentSpec>, String), String> {
    let http = match reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(5))
        .build()
    {
        Ok(c) => c,
        Err(e) => return Ok((None, format!("agent layer: off (no HTTP client: {e})"))),
    };
    let get = |url: String| {
        let mut r = http.get(url);
        if let Some(k) = worker_key {
            r = r.bearer_auth(k);
        }
        async move {
            let r = r.send().await.ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.json::<serde_json::Value>().await.ok()
        }
    };
    let mut seen = Vec::new();
    for w in workers {
        let w = w.trim_end_matches('/');
        let (Some(info), models) = (
            get(format!("{w}/server_info")).await,
            get(format!("{w}/v1/models")).await,
        ) else {
            continue;
        };
        let first = models.as_ref().and_then(|m| m["data"].get(0)).cloned();
        let listed = first
            .as_ref()
            .and_then(|m| m["id"].as_str())
            .map(str::to_string);
        let reference = info["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("troupe-engine"));
        let paths = [
            info["model_path"].as_str(),
            info["vllm_config"]["model_config"]["model"].as_str(),
            first.as_ref().and_then(|m| m["root"].as_str()),
        ];
        let tokenizer = if reference {
            Some("reference".to_string())
        } else {
            paths
                .iter()
                .flatten()
                .find(|p| std::path::Path::new(p).join("tokenizer.json").is_file())
                .map(|p| p.to_string())
        };
        let Some(t) = tokenizer else {
            seen.extend(paths.iter().flatten().map(|p| p.to_string()));
            continue;
        };
        let o = AgentOptions {
            tokenizer: Some(t.clone()),
            served_model_name: f.served_model_name.clone().or(listed),
            ..options(f)
        };
        let s = agent_spec(&o, |k| format!("--{}", k.replace('_', "-")))?;
        let line = match &s {
            Some(s) => format!(
                "agent layer: tokenizer {t} (from worker {w}) with its tokenizer_config.json chat template, model {:?}",
                s.model
            ),
            None => "agent layer: off".into(),
        };
        return Ok((s, line));
    }
    let why = if workers.is_empty() {
        "no workers at start to ask for their model".to_string()
    } else if seen.is_empty() {
        "no worker answered /server_info with its model".to_string()
    } else {
        format!(
            "the workers' model ({}) is not a directory on this machine holding tokenizer.json",
            seen.join(", ")
        )
    };
    Ok((
        None,
        format!(
            "agent layer: off: {why}; give --tokenizer (a model directory, or reference) for chat, messages, responses and /sessions"
        ),
    ))
}

fn options(f: &AgentFlags) -> AgentOptions {
    AgentOptions {
        tokenizer: f.tokenizer.clone(),
        served_model_name: f.served_model_name.clone(),
        tool_call_parser: f.tool_call_parser.clone(),
        reasoning_parser: f.reasoning_parser.clone(),
        max_agent_sessions: f.max_agent_sessions,
        max_session_tokens: f.max_session_tokens,
        session_idle_ttl_secs: f.session_idle_ttl_secs,
        session_dir: f.session_dir.clone(),
    }
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
        assert_eq!(
            spec(&f).unwrap().map(|s| s.model),
            Some("troupe-tiny".into())
        );
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
