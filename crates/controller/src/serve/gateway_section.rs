//! `gateway.*` of the serve config: the router and gateway settings, in the names of `troupe
//! gateway`'s flags (SGLang router's for the `cache_aware` keys). Kept apart from the rest of the
//! config so each file stays one concern.

use serde::Deserialize;
use troupe_serving::RouterConfig;
use troupe_serving::gateway::{ControlAuthMode, GatewayConfig};
use troupe_serving::policy::{CacheAwareConfig, PolicyKind, StickyConfig};

/// `gateway.*`: the YAML face of [`troupe_serving::gateway::GatewayConfig`] (the one gateway
/// settings type), with its defaults. Policies are typed, so a typo is an error at load, naming
/// the key, before anything launches.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySection {
    /// Address the gateway listens on (default: its host's address, port 0 — `127.0.0.1:0`
    /// when every host is on this machine). A non-loopback address needs an admin key.
    #[serde(default)]
    pub listen: String,
    /// Policy for regular workers, and the default for prefill / decode.
    #[serde(default)]
    pub policy: PolicyKind,
    /// Policy for prefill workers (default: `policy`).
    #[serde(default)]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy for decode workers (default: `policy`).
    #[serde(default)]
    pub decode_policy: Option<PolicyKind>,
    /// Retries of a failed request on another worker (default: the gateway's).
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// Who may call the fleet control endpoints on the gateway: `key` (the admin key; the
    /// default) or `none` (open, for clients such as SkyRL's that send no key; only with a
    /// loopback `listen`).
    #[serde(default)]
    pub control_auth: ControlAuthMode,
    /// The read-only control endpoints (versions, server and model info, `is_paused`) need the
    /// admin key too (default false: open, as SGLang and vLLM leave them).
    #[serde(default)]
    pub key_reads: bool,
    /// `cache_aware` policies: share of a prompt a worker must hold to get it (SGLang's name
    /// and default, 0.3).
    #[serde(default)]
    pub cache_threshold: Option<f64>,
    /// `cache_aware` policies: loads are imbalanced past this difference in requests in flight
    /// (and `balance_rel_threshold`) (SGLang's default, 64).
    #[serde(default)]
    pub balance_abs_threshold: Option<usize>,
    /// `cache_aware` policies: loads are imbalanced past this ratio (and
    /// `balance_abs_threshold`) (SGLang's default, 1.5).
    #[serde(default)]
    pub balance_rel_threshold: Option<f64>,
    /// `cache_aware` policies: seconds between cache-tree sweeps (SGLang's default, 60).
    #[serde(default)]
    pub eviction_interval_secs: Option<u64>,
    /// `cache_aware` policies: characters each worker's cache tree keeps (SGLang's default,
    /// 2^26).
    #[serde(default)]
    pub max_tree_size: Option<usize>,
    /// `sticky_least_loaded` policies: seconds a session binding may stay unused (default
    /// 7200).
    #[serde(default)]
    pub session_ttl_secs: Option<u64>,
    /// `sticky_least_loaded` policies: most session bindings kept (default 262144).
    #[serde(default)]
    pub max_sessions: Option<usize>,
    /// `sticky_least_loaded` policies: requests in flight at which a bound engine passes a
    /// turn on (default 0: no cap).
    #[serde(default)]
    pub session_max_inflight: Option<usize>,
    /// Threads of its own the gateway serves on, one single-threaded runtime each (default 0:
    /// the runtime of the host it runs on; `troupe gateway` uses one per core).
    #[serde(default)]
    pub io_threads: Option<usize>,
    /// The agent routes' tokenizer: `auto` (the default: the engines' own model's, found where
    /// the gateway can know it: `reference` for the reference engine, else `sglang.model_path`
    /// when it is a directory on this machine holding `tokenizer.json`), `reference`, a model
    /// directory, or `none` (a pure inference gateway: chat passes through, no sessions). With
    /// it the gateway serves chat, Anthropic messages and Responses from token ids and records
    /// sessions.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// What the agent layer runs with, or why there is none: the start-up line's words, set
    /// when the config is loaded.
    #[serde(skip)]
    pub agent_note: String,
    /// The model name agent requests give (default: the name the engines list, `troupe-tiny`
    /// for the reference engine's default model, else `--served-model-name` or the model path).
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// Tool-call parser: hermes | reference | none.
    #[serde(default)]
    pub tool_call_parser: Option<String>,
    /// Reasoning parser: qwen3 | deepseek_r1 | none.
    #[serde(default)]
    pub reasoning_parser: Option<String>,
    /// Recorded sessions open at once, at most (default 4096).
    #[serde(default)]
    pub max_agent_sessions: Option<usize>,
    /// Tokens one session may record, at most (default 1048576).
    #[serde(default)]
    pub max_session_tokens: Option<usize>,
    /// Idle seconds before a recorded session is dropped (default 3600).
    #[serde(default)]
    pub session_idle_ttl_secs: Option<u64>,
    /// Where recorded sessions are written as they happen, so a gateway started again over the
    /// same directory continues them (default: `STATE_FILE.sessions` when the deployment keeps
    /// a state file, else none: in memory only). A path on the gateway's host.
    #[serde(default)]
    pub session_dir: Option<std::path::PathBuf>,
}

impl GatewaySection {
    /// The gateway settings this section describes (no workers, no admin key yet: the fork adds
    /// them). An empty `listen` stays empty: the fork puts the gateway on its host's address.
    pub fn to_gateway(&self) -> GatewayConfig {
        let d = GatewayConfig::default();
        GatewayConfig {
            listen: self.listen.clone(),
            router: RouterConfig {
                policy: self.policy,
                prefill_policy: self.prefill_policy.unwrap_or(self.policy),
                decode_policy: self.decode_policy.unwrap_or(self.policy),
                cache_aware: self.cache_aware(),
                sessions: self.sessions(),
                ..d.router.clone()
            },
            max_retries: self.max_retries.unwrap_or(d.max_retries),
            control_auth: self.control_auth,
            key_reads: self.key_reads,
            io_threads: self.io_threads.unwrap_or(d.io_threads),
            // `check` ran at load and reported a bad tokenizer; here it only repeats the work.
            agent: self.agent().ok().flatten(),
            ..d
        }
    }

    /// `gateway.tokenizer` made concrete. Unset or `auto`: the engines' own model's tokenizer,
    /// the reference engine's built-in one (`reference_engine`: the plan runs it), else the
    /// model directory the engines load when it holds `tokenizer.json` here. Unset and no such
    /// directory: no agent layer, and [`Self::agent_note`] says why (`auto` keeps the path, so
    /// loading it reports what is missing). `none`: no agent layer. `engine_flags`: the
    /// engines' flags, whose `--served-model-name` the agent layer's default name follows.
    pub(super) fn resolve_tokenizer(
        &mut self,
        model_path: &str,
        reference_engine: bool,
        engine_flags: &[String],
    ) {
        let asked = self.tokenizer.clone();
        match asked.as_deref() {
            Some("none") => {
                self.tokenizer = None;
                self.agent_note = "off (gateway.tokenizer: none)".into();
                return;
            }
            None | Some("auto") => {}
            Some(t) => {
                self.agent_note = format!("tokenizer {t} (gateway.tokenizer)");
                return;
            }
        }
        let dir = std::path::Path::new(model_path);
        let (tokenizer, why) = if reference_engine {
            (
                Some("reference".to_string()),
                "the reference engine's built-in tokenizer".to_string(),
            )
        } else if dir.join("tokenizer.json").is_file() {
            (
                Some(model_path.to_string()),
                format!("{model_path}/tokenizer.json, the engines' model"),
            )
        } else if asked.is_some() {
            // `auto` asked for it: loading the path names what is missing.
            (Some(model_path.to_string()), String::new())
        } else {
            (
                None,
                format!(
                    "off: the engines' model {model_path:?} is not a directory on this machine holding tokenizer.json; set gateway.tokenizer to a model directory for chat, messages, responses and /sessions"
                ),
            )
        };
        self.tokenizer = tokenizer;
        if self.tokenizer.is_none() {
            self.agent_note = why;
            return;
        }
        // The agent layer answers to the name the engines list, so a client that reads
        // `/v1/models` and names that model reaches it.
        if self.served_model_name.is_none() {
            self.served_model_name = served_name_flag(engine_flags).or_else(|| {
                reference_engine.then(|| match model_path {
                    "small" => "troupe-small".to_string(),
                    _ => super::agent_spec::REFERENCE_MODEL.to_string(),
                })
            });
        }
        self.agent_note = why;
    }

    /// The start-up line's words for the agent layer: its tokenizer, template and model name,
    /// or why it is off.
    pub fn agent_line(&self) -> String {
        match self.agent() {
            Ok(Some(spec)) => format!(
                "agent layer: {} with its tokenizer_config.json chat template, model {:?}, tool-call parser {}, reasoning parser {}, sessions {} (POST /sessions, /v1/chat/completions, /v1/messages, /v1/responses)",
                if self.agent_note.is_empty() {
                    self.tokenizer.clone().unwrap_or_default()
                } else {
                    self.agent_note.clone()
                },
                spec.model,
                spec.tool_call_parser,
                spec.reasoning_parser,
                spec.session_dir.as_ref().map_or_else(
                    || "in memory only".to_string(),
                    |d| format!("kept in {}", d.display())
                )
            ),
            Ok(None) if self.agent_note.is_empty() => "agent layer: off".into(),
            Ok(None) => format!("agent layer: {}", self.agent_note),
            Err(e) => format!("agent layer: off ({e})"),
        }
    }

    /// The agent layer of `gateway.tokenizer` and its keys.
    fn agent(&self) -> Result<Option<troupe_agent::AgentSpec>, String> {
        let o = super::agent_spec::AgentOptions {
            tokenizer: self.tokenizer.clone(),
            served_model_name: self.served_model_name.clone(),
            tool_call_parser: self.tool_call_parser.clone(),
            reasoning_parser: self.reasoning_parser.clone(),
            max_agent_sessions: self.max_agent_sessions,
            max_session_tokens: self.max_session_tokens,
            session_idle_ttl_secs: self.session_idle_ttl_secs,
            session_dir: self.session_dir.clone(),
        };
        super::agent_spec::agent_spec(&o, |k| format!("gateway.{k}"))
    }

    /// The `cache_aware` settings: the keys given, SGLang's defaults for the rest.
    fn cache_aware(&self) -> CacheAwareConfig {
        let d = CacheAwareConfig::default();
        CacheAwareConfig {
            cache_threshold: self.cache_threshold.unwrap_or(d.cache_threshold),
            balance_abs_threshold: self
                .balance_abs_threshold
                .unwrap_or(d.balance_abs_threshold),
            balance_rel_threshold: self
                .balance_rel_threshold
                .unwrap_or(d.balance_rel_threshold),
            eviction_interval_secs: self
                .eviction_interval_secs
                .unwrap_or(d.eviction_interval_secs),
            max_tree_size: self.max_tree_size.unwrap_or(d.max_tree_size),
        }
    }

    /// The `sticky_least_loaded` settings: the keys given, defaults for the rest.
    fn sessions(&self) -> StickyConfig {
        let d = StickyConfig::default();
        StickyConfig {
            session_ttl_secs: self.session_ttl_secs.unwrap_or(d.session_ttl_secs),
            max_sessions: self.max_sessions.unwrap_or(d.max_sessions),
            session_max_inflight: self.session_max_inflight.unwrap_or(d.session_max_inflight),
        }
    }

    pub(super) fn check(&self) -> Result<(), String> {
        self.cache_aware().check(|k| format!("gateway.{k}"))?;
        self.agent()?;
        self.sessions().check(|k| format!("gateway.{k}"))?;
        if let Some(n) = self.io_threads
            && n > troupe_serving::gateway::MAX_IO_THREADS
        {
            return Err(format!(
                "gateway.io_threads {n} is more than {}; give about one per core (0 serves on the host's runtime)",
                troupe_serving::gateway::MAX_IO_THREADS
            ));
        }
        let host_port = |s: &str| {
            s.parse::<std::net::SocketAddr>().is_ok()
                || s.rsplit_once(':').is_some_and(|(h, p)| {
                    !h.is_empty() && !h.contains(char::is_whitespace) && p.parse::<u16>().is_ok()
                })
        };
        if !self.listen.is_empty() && !host_port(&self.listen) {
            return Err(format!(
                "gateway.listen {:?} is not an IP:PORT address, e.g. 127.0.0.1:30000 (or leave it empty for the gateway host's own address)",
                self.listen
            ));
        }
        let loopback = self
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if self.control_auth == ControlAuthMode::None && !loopback {
            return Err(format!(
                "gateway.control_auth none opens the fleet control endpoints to anyone who reaches the gateway, so it needs a loopback gateway.listen such as 127.0.0.1:30000 (got {:?}); or keep control_auth: key",
                self.listen
            ));
        }
        Ok(())
    }
}

/// `--served-model-name NAME` (or `=NAME`) among an engine's flags.
fn served_name_flag(flags: &[String]) -> Option<String> {
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        if let Some(v) = f.strip_prefix("--served-model-name=") {
            return Some(v.to_string());
        }
        if f == "--served-model-name" {
            return it.next().cloned();
        }
    }
    None
}
