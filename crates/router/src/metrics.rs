//! Gateway metrics in Prometheus text format.
//!
//! Lock-free counters on the request path; `/metrics` renders them together with each worker's
//! in-flight load and health read live from the router.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use super::router::Router;

/// The inference endpoints counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/generate`.
    Generate,
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    ChatCompletions,
}

impl Endpoint {
    const ALL: [Endpoint; 3] = [
        Endpoint::Generate,
        Endpoint::Completions,
        Endpoint::ChatCompletions,
    ];

    /// The upstream path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Generate => ep::Generate::PATH,
            Endpoint::Completions => ep::Completions::PATH,
            Endpoint::ChatCompletions => ep::ChatCompletions::PATH,
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// Histogram bucket bounds in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// The gateway's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [AtomicU64; 3],
    errors: [AtomicU64; 3],
    retries: AtomicU64,
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Metrics {
    /// Counts an incoming request.
    pub fn request(&self, ep: Endpoint) {
        self.requests[ep.idx()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request answered with an error.
    pub fn error(&self, ep: Endpoint) {
        self.errors[ep.idx()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one retry.
    pub fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// Retries so far.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Records the time until a response started (whole response for non-stream requests).
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self, router: &Router) -> String {
        let mut o = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_requests_total Requests received, by endpoint."
        );
        let _ = writeln!(o, "# TYPE troupe_gateway_requests_total counter");
        for ep in Endpoint::ALL {
            let _ = writeln!(
                o,
                "troupe_gateway_requests_total{{endpoint=\"{}\"}} {}",
                ep.path(),
                get(&self.requests[ep.idx()])
            );
        }
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_errors_total Requests answered with an error status, by endpoint."
        );
        let _ = writeln!(o, "# TYPE troupe_gateway_errors_total counter");
        for ep in Endpoint::ALL {
            let _ = writeln!(
                o,
                "troupe_gateway_errors_total{{endpoint=\"{}\"}} {}",
                ep.path(),
                get(&self.errors[ep.idx()])
            );
        }
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_retries_total Attempts retried on another worker (pair)."
        );
        let _ = writeln!(o, "# TYPE troupe_gateway_retries_total counter");
        let _ = writeln!(o, "troupe_gateway_retries_total {}", self.retries());
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_worker_in_flight Requests in flight per worker."
        );
        let _ = writeln!(o, "# TYPE troupe_gateway_worker_in_flight gauge");
        let workers = router.list();
        for w in &workers {
            let _ = writeln!(
                o,
                "troupe_gateway_worker_in_flight{{worker=\"{}\",url=\"{}\",type=\"{}\"}} {}",
                w.id, w.url, w.worker_type, w.load
            );
        }
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_worker_healthy 1 while a worker passes health checks."
        );
        let _ = writeln!(o, "# TYPE troupe_gateway_worker_healthy gauge");
        for w in &workers {
            let _ = writeln!(
                o,
                "troupe_gateway_worker_healthy{{worker=\"{}\",url=\"{}\",type=\"{}\"}} {}",
                w.id,
                w.url,
                w.worker_type,
                u8::from(w.is_healthy)
            );
        }
        let _ = writeln!(
            o,
            "# HELP troupe_gateway_request_duration_seconds Time until the response starts (whole response when not streamed)."
        );
        let _ = writeln!(
            o,
            "# TYPE troupe_gateway_request_duration_seconds histogram"
        );
        let mut cum = 0;
        for (b, c) in BUCKETS.iter().zip(&self.buckets) {
            cum += get(c);
            let _ = writeln!(
                o,
                "troupe_gateway_request_duration_seconds_bucket{{le=\"{b}\"}} {cum}"
            );
        }
        let count = get(&self.count);
        let _ = writeln!(
            o,
            "troupe_gateway_request_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            o,
            "troupe_gateway_request_duration_seconds_sum {}",
            get(&self.sum_us) as f64 / 1e6
        );
        let _ = writeln!(o, "troupe_gateway_request_duration_seconds_count {count}");
        o
    }
}
