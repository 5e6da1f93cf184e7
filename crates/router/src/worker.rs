//! Workers: the inference servers a router can send requests to.
//!
//! The [`Worker`] trait is the seam between routing and the rest: policies read a worker's load
//! and availability, the gateway takes load guards on it and reports outcomes, the health
//! checker flips its health. [`HttpWorker`] is the one implementation (an SGLang-compatible
//! HTTP server); tests and other transports can bring their own.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use super::breaker::{BreakerConfig, BreakerState, CircuitBreaker};
use troupe_http::error::ServingError;

/// The role a server plays: SGLang's `worker_type` of `POST /workers` (defined in `troupe-wire`).
pub use troupe_wire::WorkerType;

use troupe_wire::{EngineDialect, WeightVersion};

/// What registering a worker takes: the body of SGLang's `POST /workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Base URL, `http://host:port`.
    pub url: String,
    /// Role; defaults to regular.
    #[serde(default = "regular")]
    pub worker_type: WorkerType,
    /// Prefill only: the KV bootstrap port decode servers connect to. `None` lets each decode
    /// use its own `--disaggregation-bootstrap-port` (SGLang sends `null` then).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Prefill only: the host decode servers connect to (defaults to the URL's host).
    #[serde(default)]
    pub bootstrap_host: Option<String>,
}

fn regular() -> WorkerType {
    WorkerType::Regular
}

impl WorkerSpec {
    /// A regular worker at `url`.
    pub fn regular(url: impl Into<String>) -> Self {
        Self::new(url, WorkerType::Regular, None)
    }

    /// A prefill worker at `url` with its bootstrap port.
    pub fn prefill(url: impl Into<String>, bootstrap_port: Option<u16>) -> Self {
        Self::new(url, WorkerType::Prefill, bootstrap_port)
    }

    /// A decode worker at `url`.
    pub fn decode(url: impl Into<String>) -> Self {
        Self::new(url, WorkerType::Decode, None)
    }

    fn new(url: impl Into<String>, worker_type: WorkerType, bootstrap_port: Option<u16>) -> Self {
        Self {
            url: url.into(),
            worker_type,
            bootstrap_port,
            bootstrap_host: None,
        }
    }
}

/// Splits `http://host:port[/]` into the worker's canonical URL and its host.
///
/// One worker has one URL: the scheme and host are lowercased, `localhost` is `127.0.0.1`, IP
/// addresses are written in their canonical form (`[::ffff:127.0.0.1]` is `127.0.0.1`), the
/// port loses leading zeros and trailing slashes are dropped, so `http://localhost:30000/` and
/// `http://127.0.0.1:30000` are recognised as the same worker. Refused: other schemes, a path,
/// query or fragment, a missing or zero port, the unspecified address (`0.0.0.0`, `[::]`: a
/// listen address, not one to reach a worker at) and credentials (`user:pass@`), which would be
/// shown by `GET /workers` and on the gateway's unauthenticated `/metrics`.
pub fn parse_url(url: &str) -> Result<(String, String), ServingError> {
    let bad = |why: &str| {
        ServingError::InvalidWorker(format!(
            "url {url:?} {why}; give e.g. \"http://10.0.0.5:30000\""
        ))
    };
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("must start with http://"))?;
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(bad(
            "must start with http:// (workers are reached over plain HTTP)",
        ));
    }
    let authority = rest.trim_end_matches('/');
    if authority.contains('@') {
        return Err(bad(
            "must not contain credentials (user:password@): worker URLs are shown by GET /workers and on the unauthenticated /metrics; authenticate to workers with the gateway's worker_api_key instead",
        ));
    }
    if authority.is_empty() || authority.contains(['/', '?', '#']) {
        return Err(bad("must be scheme://host:port with no path"));
    }
    if authority
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(bad("must not contain whitespace"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| bad("has an unclosed [IPv6] address"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| bad("needs an explicit port"))?;
        let ip = h
            .parse::<std::net::Ipv6Addr>()
            .map_err(|_| bad("has an invalid IPv6 address"))?;
        (std::net::IpAddr::V6(ip).to_canonical().to_string(), port)
    } else {
        let (h, p) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !h.contains(':') => (h, p),
            Some((h, _)) if h.contains(':') => {
                return Err(bad("has an IPv6 address without [brackets]"));
            }
            _ => return Err(bad("needs an explicit port")),
        };
        (canonical_host(h).map_err(|why| bad(&why))?, p)
    };
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("has an invalid port"))?;
    if host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(bad(
            "is the unspecified address (where a server listens, not where it is reached)",
        ));
    }
    let shown = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    Ok((format!("http://{shown}:{port}"), host))
}

/// A host name or IPv4 address in its one spelling: lowercase, no trailing dot, `localhost` as
/// `127.0.0.1`, IPv4 addresses in dotted decimal whichever way they were written. A host whose
/// last label is a number is an IPv4 address, read as the resolver (`inet_aton`) and URL
/// parsers read it: one to four parts, each decimal, octal (leading `0`) or hex (`0x`), so
/// `0x7f.0.0.1`, `0x7f000001`, `2130706433` and `127.1` are all `127.0.0.1`.
fn canonical_host(host: &str) -> Result<String, String> {
    let h = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if h == "localhost" {
        return Ok("127.0.0.1".into());
    }
    if ends_in_number(&h) {
        return numeric_ipv4(&h)
            .map(|ip| ip.to_string())
            .ok_or_else(|| "has an invalid IPv4 address".to_string());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    if h.len() > 253 || !h.split('.').all(label_ok) {
        return Err("has an invalid host name".into());
    }
    Ok(h)
}

/// Whether the last dot-separated label of `host` is a number (decimal digits, or `0x` and hex
/// digits): then the host is an IPv4 address or invalid, never a name.
fn ends_in_number(host: &str) -> bool {
    let last = host.rsplit('.').next().unwrap_or("");
    (!last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()))
        || last
            .strip_prefix("0x")
            .is_some_and(|x| x.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `inet_aton`'s reading of a numeric IPv4 host (see [`canonical_host`]).
fn numeric_ipv4(host: &str) -> Option<std::net::Ipv4Addr> {
    let parts: Vec<&str> = host.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut nums = Vec::with_capacity(parts.len());
    for p in &parts {
        let n = if let Some(x) = p.strip_prefix("0x") {
            if x.is_empty() {
                0
            } else {
                u64::from_str_radix(x, 16).ok()?
            }
        } else if p.len() > 1 && p.starts_with('0') {
            u64::from_str_radix(&p[1..], 8).ok()?
        } else if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
            p.parse::<u64>().ok()?
        } else {
            return None;
        };
        nums.push(n);
    }
    let (last, head) = nums.split_last()?;
    if head.iter().any(|n| *n > 255) {
        return None;
    }
    let room = 8 * (5 - nums.len() as u32);
    if room < 64 && *last >= 1u64 << room {
        return None;
    }
    let mut v: u64 = *last;
    for (i, n) in head.iter().enumerate() {
        v += n << (8 * (3 - i as u32));
    }
    u32::try_from(v).ok().map(std::net::Ipv4Addr::from)
}

/// The worker type a server reports for itself: SGLang's `disaggregation_mode` in
/// `/server_info` (`"null"` or JSON null is a regular server). `None` for a value this gateway
/// does not know, which is then not checked.
pub fn type_of_mode(mode: &serde_json::Value) -> Option<WorkerType> {
    match mode {
        serde_json::Value::Null => Some(WorkerType::Regular),
        serde_json::Value::String(s) => match s.as_str() {
            "null" | "" => Some(WorkerType::Regular),
            "prefill" => Some(WorkerType::Prefill),
            "decode" => Some(WorkerType::Decode),
            _ => None,
        },
        _ => None,
    }
}

/// One worker as the admin API reports it (SGLang's `WorkerInfo` fields plus ours).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Stable id (also accepted by `DELETE /workers/{id}`).
    pub id: String,
    /// Base URL.
    pub url: String,
    /// Role.
    pub worker_type: WorkerType,
    /// Prefill bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// Prefill bootstrap host.
    pub bootstrap_host: String,
    /// Health as the prober sees it.
    pub is_healthy: bool,
    /// Circuit breaker state: `closed`, `open` or `half_open`.
    pub circuit: String,
    /// Requests in flight (responses not fully delivered yet).
    pub load: usize,
    /// Requests routed to this worker so far.
    pub total_requests: u64,
    /// Held out of routing by the fleet (new or back from a failure, and not yet known to hold
    /// the fleet's weight version).
    #[serde(default)]
    pub held: bool,
    /// The weight version it serves as far as the gateway knows (its registration, then the
    /// fleet at every update); absent while unknown, as during an update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<WeightVersion>,
    /// Always `http`.
    pub connection_mode: String,
}

/// A server a router can send requests to.
pub trait Worker: Send + Sync + fmt::Debug {
    /// Stable id.
    fn id(&self) -> &str;
    /// Base URL (`http://host:port`, no trailing slash).
    fn url(&self) -> &str;
    /// Role.
    fn worker_type(&self) -> WorkerType;
    /// Prefill: host decode servers fetch KV from.
    fn bootstrap_host(&self) -> &str;
    /// Prefill: KV bootstrap port.
    fn bootstrap_port(&self) -> Option<u16>;
    /// Requests in flight.
    fn load(&self) -> usize;
    /// Adds one in-flight request (use [`super::guard::LoadGuard`], not this directly).
    fn increment_load(&self);
    /// Removes one in-flight request.
    fn decrement_load(&self);
    /// Whether health probes say it is up.
    fn is_healthy(&self) -> bool;
    /// Sets health (the prober, or an operator marking it down).
    fn set_healthy(&self, healthy: bool);
    /// Whether it may take a request now: healthy, not held, and its circuit lets requests
    /// through.
    fn is_available(&self) -> bool;
    /// Holds it out of routing (`true`) or routes it again: the fleet's say, apart from health
    /// (a worker on another weight version is healthy but must not serve).
    fn set_held(&self, _held: bool) {}
    /// Whether the fleet holds it out of routing.
    fn is_held(&self) -> bool {
        false
    }
    /// The weight version it serves, as far as the gateway knows (registration, and the
    /// fleet at every update); `None` while unknown, as during an update. Requests that ask for
    /// a version (`troupe_wire::want`) go only to workers known to serve a matching one.
    fn weight_version(&self) -> Option<Arc<WeightVersion>> {
        None
    }
    /// Records the version it serves (`None`: unknown from now on). Typed, so a string from an
    /// engine's answer or a header is checked where it is read, not here.
    fn set_weight_version(&self, _version: Option<WeightVersion>) {}
    /// Reports the outcome of one request (feeds the circuit breaker).
    fn record_outcome(&self, success: bool);
    /// The admin API's view.
    fn info(&self) -> WorkerInfo;
    /// The URI of `path` (e.g. `/generate`, optionally with a query) on this worker, for the
    /// gateway's [`troupe_http::upstream::UpstreamClient`] client; `None` when it does not parse (the
    /// caller then reports the bad URL).
    fn endpoint(&self, path: &str) -> Option<axum::http::Uri> {
        format!("{}{path}", self.url()).parse().ok()
    }
    /// The protocol the server speaks, as registration found it: a route whose paths and
    /// bodies differ between SGLang and vLLM (`/inference/v1/generate`) is sent in this one.
    fn dialect(&self) -> EngineDialect {
        EngineDialect::Sglang
    }
}

/// An SGLang-compatible HTTP server.
#[derive(Debug)]
pub struct HttpWorker {
    id: String,
    url: String,
    worker_type: WorkerType,
    bootstrap_host: String,
    bootstrap_port: Option<u16>,
    load: AtomicUsize,
    total: AtomicU64,
    healthy: AtomicBool,
    held: AtomicBool,
    /// The version it serves, as far as the gateway knows ([`Worker::weight_version`]).
    version: parking_lot::Mutex<Option<Arc<WeightVersion>>>,
    /// Speaks vLLM's dialect (set once, at registration, from what the server answers).
    vllm: AtomicBool,
    breaker: CircuitBreaker,
    /// `url`'s `host:port`, parsed once: parsing the whole URL per request (host and IDNA
    /// checks) was about 5% of the gateway's CPU per request.
    authority: Option<axum::http::uri::Authority>,
}

impl HttpWorker {
    /// Validates `spec` and builds the worker (healthy until a probe says otherwise).
    pub fn new(spec: &WorkerSpec, breaker: BreakerConfig) -> Result<Arc<Self>, ServingError> {
        let (url, host) = parse_url(&spec.url)?;
        if spec.worker_type != WorkerType::Prefill
            && (spec.bootstrap_port.is_some() || spec.bootstrap_host.is_some())
        {
            return Err(ServingError::InvalidWorker(format!(
                "{} is a {} worker; only prefill workers take bootstrap_port / bootstrap_host",
                spec.url, spec.worker_type
            )));
        }
        let id = format!(
            "{}-{}",
            spec.worker_type,
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        Ok(Arc::new(Self {
            id,
            worker_type: spec.worker_type,
            bootstrap_host: spec.bootstrap_host.clone().unwrap_or(host),
            bootstrap_port: spec.bootstrap_port,
            load: AtomicUsize::new(0),
            total: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            held: AtomicBool::new(false),
            version: parking_lot::Mutex::new(None),
            vllm: AtomicBool::new(false),
            breaker: CircuitBreaker::new(breaker),
            authority: url.strip_prefix("http://").and_then(|a| a.parse().ok()),
            url,
        }))
    }
}

impl HttpWorker {
    /// Records the protocol the server speaks (registration asks it before it is routed).
    pub fn set_dialect(&self, dialect: EngineDialect) {
        self.vllm
            .store(dialect == EngineDialect::Vllm, Ordering::Relaxed);
    }
}

impl Worker for HttpWorker {
    fn id(&self) -> &str {
        &self.id
    }
    fn url(&self) -> &str {
        &self.url
    }
    fn worker_type(&self) -> WorkerType {
        self.worker_type
    }
    fn bootstrap_host(&self) -> &str {
        &self.bootstrap_host
    }
    fn bootstrap_port(&self) -> Option<u16> {
        self.bootstrap_port
    }
    fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }
    fn increment_load(&self) {
        self.load.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }
    fn decrement_load(&self) {
        // Saturating: a stray extra decrement must never wrap to usize::MAX.
        let _ = self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }
    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }
    fn is_available(&self) -> bool {
        self.is_healthy() && !self.is_held() && self.breaker.allows()
    }
    fn set_held(&self, held: bool) {
        self.held.store(held, Ordering::Relaxed);
    }
    fn is_held(&self) -> bool {
        self.held.load(Ordering::Relaxed)
    }
    fn dialect(&self) -> EngineDialect {
        if self.vllm.load(Ordering::Relaxed) {
            EngineDialect::Vllm
        } else {
            EngineDialect::Sglang
        }
    }
    fn record_outcome(&self, success: bool) {
        self.breaker.record(success);
    }
    fn weight_version(&self) -> Option<Arc<WeightVersion>> {
        self.version.lock().clone()
    }
    fn set_weight_version(&self, version: Option<WeightVersion>) {
        *self.version.lock() = version.map(Arc::new);
    }
    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            id: self.id.clone(),
            url: self.url.clone(),
            worker_type: self.worker_type,
            bootstrap_port: self.bootstrap_port,
            bootstrap_host: self.bootstrap_host.clone(),
            is_healthy: self.is_healthy(),
            circuit: match self.breaker.state() {
                BreakerState::Closed => "closed",
                BreakerState::Open => "open",
                BreakerState::HalfOpen => "half_open",
            }
            .to_string(),
            load: self.load(),
            total_requests: self.total.load(Ordering::Relaxed),
            held: self.is_held(),
            weight_version: self.weight_version().map(|v| WeightVersion::clone(&v)),
            connection_mode: "http".into(),
        }
    }
    fn endpoint(&self, path: &str) -> Option<axum::http::Uri> {
        // `url` is always `http://host:port` ([`parse_url`]): only the path changes.
        let authority = self.authority.clone()?;
        axum::http::Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query(path)
            .build()
            .ok()
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
