//! What `troupe bench scale` checks through the deployment beyond the fan-out: a weight-version
//! change to every server (and, with stub engines, when each one switched), and `/generate`
//! through the gateway; with the percentile and error helpers the bench shares.

use std::time::Instant;

use troupe_controller::serve::Deployment;

/// Percentile `p` (0..=1) of sorted millisecond samples.
pub(super) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A plane error as the bench reports it: what failed, and why.
pub(super) fn api(what: &str, e: troupe_wire::ApiError) -> String {
    format!("{what}: {}", e.message)
}

/// A weight-version change through the plane (`/update_weight_version` to every server):
/// `version_change_ms`, the call until every server answered; with stand-ins also
/// `version_seen_all_ms`, from the call to the last stand-in switching (each logs the instant
/// it switched, on this process's clock), and `version_seen_servers`, how many did.
pub(super) async fn version_change(
    svc: &Deployment,
    stub: bool,
    put: &mut impl FnMut(&str, f64),
) -> Result<(), String> {
    let version = format!("scale-version-{}", std::process::id());
    let asked_ns = unix_ns();
    let t = Instant::now();
    svc.plane
        .set_version(&version)
        .await
        .map_err(|e| api("version change", e))?;
    put("version_change_ms", t.elapsed().as_secs_f64() * 1e3);
    if stub {
        let (seen, last_ns) = switched(svc, &version).await;
        put("version_seen_servers", seen as f64);
        put(
            "version_seen_all_ms",
            last_ns.saturating_sub(asked_ns) as f64 / 1e6,
        );
    }
    Ok(())
}

/// Now on the wall clock, in ns since the Unix epoch.
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// How many stand-ins hold `version`, and the latest wall-clock time one of them switched to
/// it (ns since the epoch), from every server's `/server_info` (64 asked at a time).
async fn switched(svc: &Deployment, version: &str) -> (usize, u64) {
    use futures::StreamExt;
    let client = reqwest::Client::new();
    let urls: Vec<String> = svc
        .servers()
        .into_iter()
        .filter(|s| s.node_rank == 0)
        .map(|s| format!("{}/server_info", s.info.url))
        .collect();
    let answers: Vec<Option<(String, u64)>> = futures::stream::iter(urls)
        .map(|u| {
            let client = client.clone();
            async move {
                let v: serde_json::Value = client.get(&u).send().await.ok()?.json().await.ok()?;
                Some((
                    v.get("weight_version")?.as_str()?.to_string(),
                    v.get("weight_version_switched_unix_ns")?.as_u64()?,
                ))
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    answers
        .into_iter()
        .flatten()
        .filter(|(v, _)| v == version)
        .fold((0, 0), |(n, last), (_, at)| (n + 1, last.max(at)))
}

/// `n` `/generate` calls one after another through the gateway: their p50 and p99 in ms (a
/// check that the router routes at this size, and what one request costs there).
pub(super) async fn generate(svc: &Deployment, n: usize) -> Result<(f64, f64), String> {
    let client = reqwest::Client::new();
    let url = format!("{}/generate", svc.gateway_url);
    let body = serde_json::json!({"text": "scale", "sampling_params": {"max_new_tokens": 1}});
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = client
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("generate through the gateway: {e}"))?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(format!("generate through the gateway: {status}: {text}"));
        }
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok((pct(&ms, 0.5), pct(&ms, 0.99)))
}

/// TCP sockets of this machine in TIME_WAIT (`/proc/net/sockstat`'s `tw`; `None` where it
/// cannot be read).
fn time_wait_sockets() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/sockstat").ok()?;
    let tcp = text.lines().find(|l| l.starts_with("TCP:"))?;
    let mut words = tcp.split_whitespace();
    words.find(|w| *w == "tw")?;
    words.next()?.parse().ok()
}

/// Most TIME_WAIT sockets a run starts with; past it, the run waits for them to drain.
const QUIET_TIME_WAIT: u64 = 2_000;

/// With `servers` of 512 or more, waits (up to 90 s, TCP's TIME_WAIT lasts 60) until the
/// machine holds at most [`QUIET_TIME_WAIT`] sockets in TIME_WAIT; returns how many it started
/// with. A run at
/// 4,096 servers opens tens of thousands of connections; the next run started within a
/// minute finds most of the ephemeral ports still held, and every `bind` to port 0 (each
/// proxy's) then searches the kernel's port table: bring-up took twice as long and some binds
/// failed outright ("Address already in use").
pub(super) async fn quiet_ports(servers: u64) -> u64 {
    let at_start = time_wait_sockets().unwrap_or(0);
    if servers < 512 {
        return at_start;
    }
    if at_start > QUIET_TIME_WAIT {
        eprintln!(
            "{at_start} sockets in TIME_WAIT (an earlier run's): waiting up to 90 s for them to drain"
        );
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(90);
    while time_wait_sockets().is_some_and(|n| n > QUIET_TIME_WAIT) && Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    at_start
}
