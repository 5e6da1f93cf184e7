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
use super::error::ServingError;

/// The role a server plays: SGLang's `worker_type` of `POST /workers` (defined in `troupe-wire`).
pub use troupe_wire::WorkerType;

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

/// Splits `http://host:port[/]` into a normalized URL (no trailing slash) and its host.
pub fn parse_url(url: &str) -> Result<(String, String), ServingError> {
    let bad = |why: &str| {
        ServingError::InvalidWorker(format!(
            "url {url:?} {why}; give e.g. \"http://10.0.0.5:30000\""
        ))
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("must start with http://"))?;
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(bad("must be scheme://host:port with no path"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() => (h, p),
        _ => return Err(bad("needs an explicit port")),
    };
    port.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("has an invalid port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((format!("http://{authority}"), host.to_string()))
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
    /// Whether it may take a request now: healthy and its circuit lets requests through.
    fn is_available(&self) -> bool;
    /// Reports the outcome of one request (feeds the circuit breaker).
    fn record_outcome(&self, success: bool);
    /// The admin API's view.
    fn info(&self) -> WorkerInfo;
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
    breaker: CircuitBreaker,
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
            url,
            worker_type: spec.worker_type,
            bootstrap_host: spec.bootstrap_host.clone().unwrap_or(host),
            bootstrap_port: spec.bootstrap_port,
            load: AtomicUsize::new(0),
            total: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            breaker: CircuitBreaker::new(breaker),
        }))
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
        self.is_healthy() && self.breaker.allows()
    }
    fn record_outcome(&self, success: bool) {
        self.breaker.record(success);
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
            connection_mode: "http".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized_and_checked() {
        assert_eq!(
            parse_url("http://127.0.0.1:30000/").unwrap(),
            ("http://127.0.0.1:30000".into(), "127.0.0.1".into())
        );
        assert_eq!(parse_url("http://[::1]:8000").unwrap().1, "::1");
        for bad in [
            "127.0.0.1:30000",
            "http://host",
            "http://h:0",
            "http://h:1/x",
            "https://h:1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bootstrap_fields_only_on_prefill() {
        let mut spec = WorkerSpec::decode("http://127.0.0.1:1");
        spec.bootstrap_port = Some(9);
        assert!(HttpWorker::new(&spec, BreakerConfig::default()).is_err());
        let w = HttpWorker::new(
            &WorkerSpec::prefill("http://10.1.2.3:1", Some(9)),
            BreakerConfig::default(),
        )
        .unwrap();
        assert_eq!(
            (w.bootstrap_host(), w.bootstrap_port()),
            ("10.1.2.3", Some(9))
        );
        w.decrement_load();
        assert_eq!(w.load(), 0, "load never wraps below zero");
    }
}
