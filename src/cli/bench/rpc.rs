//! `troupe bench rpc`: what an actor call costs, from raw ractor up to a call over loopback gRPC.
//!
//! Four paths, same work (an echo), beside the socket's floor (`rpc_floor.rs`: a raw loopback
//! ping-pong of a call-sized message, `rpc.floor.*`, and the remote paths' p50 over it,
//! `rpc.*_vs_floor.seq.ratio`): (a) a bare ractor `call`, the in-process floor; (b) a typed handle to
//! an actor on an in-process host; (c) a typed handle to an actor on a `troupe host` subprocess
//! with framed calls, and (d) the same over gRPC's `CallStream`.
//! Each is measured sequentially (latency percentiles and calls/s) and pipelined with a fixed
//! number of calls in flight (calls/s). `--vs-ray` runs Ray's equivalent in the same
//! invocation (a sync actor called sequentially; an async actor with the same calls in flight)
//! and prints the remote path's ratios to it.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use troupe_actors::builtin::diag::{Diag, DiagArgs, Echo};

use troupe_controller::{CallTransport, Cluster};

/// Settings of the RPC benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct RpcArgs {
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
    /// Calls per measurement.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    pub calls: u64,
    /// Calls in flight for the pipelined measurement.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub inflight: u64,
    /// Also measure Ray's actor calls in this run with this Python (one that can `import
    /// ray`), and print the ratios.
    #[arg(long, value_name = "PYTHON", num_args = 0..=1, default_missing_value = "python3")]
    pub vs_ray: Option<String>,
}

/// Ray's equivalent of the measurements: a sync actor called sequentially, and the same
/// number of calls pipelined through an async actor, with `inflight` in flight.
const RAY_BENCH: &str = r#"
import sys, time, statistics
import ray
n, inflight = int(sys.argv[1]), int(sys.argv[2])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

@ray.remote
class Echo:
    def echo(self, i):
        return i

@ray.remote
class AsyncEcho:
    async def echo(self, i):
        return i

a = Echo.remote()
for i in range(max(n // 10, 100)):
    ray.get(a.echo.remote(i))
lat = []
t0 = time.perf_counter()
for i in range(n):
    t = time.perf_counter()
    ray.get(a.echo.remote(i))
    lat.append(time.perf_counter() - t)
total = time.perf_counter() - t0
lat.sort()
print("seq.p50_us", lat[len(lat) // 2] * 1e6)
print("seq.p99_us", lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6)
print("seq.calls_per_s", n / total)
b = AsyncEcho.options(max_concurrency=inflight).remote()
ray.get(b.echo.remote(0))
t0 = time.perf_counter()
pending = [b.echo.remote(i) for i in range(min(n, inflight))]
sent = len(pending)
while pending:
    done, pending = ray.wait(pending, num_returns=1)
    if sent < n:
        pending.append(b.echo.remote(sent))
        sent += 1
print("pipelined.calls_per_s", n / (time.perf_counter() - t0))
ray.shutdown()
"#;

/// Runs [`RAY_BENCH`] with `python` and returns its figures as `rpc.ray.*`.
async fn ray_figures(
    python: &str,
    calls: u64,
    inflight: u64,
) -> Result<Vec<(String, f64)>, String> {
    let out = tokio::process::Command::new(python)
        .args(["-c", RAY_BENCH, &calls.to_string(), &inflight.to_string()])
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("--vs-ray: cannot run {python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!(
            "--vs-ray: {python} could not run Ray's benchmark ({}): {last}; give a Python that can `import ray` (--vs-ray /path/to/python)",
            out.status
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| {
            v.trim()
                .parse::<f64>()
                .map(|v| (format!("rpc.ray.{k}"), v))
                .map_err(|e| {
                    format!(
                        "--vs-ray: bad figure line {l:?}: {e}",
                        l = format!("{k} {v}")
                    )
                })
        })
        .collect()
}

struct RawEcho;

impl ractor::Actor for RawEcho {
    type Msg = (u64, RpcReplyPort<u64>);
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _m: ActorRef<Self::Msg>, _a: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _m: ActorRef<Self::Msg>,
        (n, reply): Self::Msg,
        _s: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let _ = reply.send(n);
        Ok(())
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

/// Times `calls` sequential calls (after a warm-up) and pushes their p50, p99 and calls/s.
pub(super) async fn sequential<F, Fut>(
    name: &str,
    calls: u64,
    call: F,
    out: &mut Vec<(String, f64)>,
) -> Result<(), String>
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    for i in 0..(calls / 10).max(100) {
        call(i).await?;
    }
    let mut lat = Vec::with_capacity(calls as usize);
    let t0 = Instant::now();
    for i in 0..calls {
        let t = Instant::now();
        call(i).await?;
        lat.push(t.elapsed());
    }
    let total = t0.elapsed();
    lat.sort_unstable();
    out.push((format!("rpc.{name}.seq.p50_us"), percentile(&lat, 0.50)));
    out.push((format!("rpc.{name}.seq.p99_us"), percentile(&lat, 0.99)));
    out.push((
        format!("rpc.{name}.seq.calls_per_s"),
        calls as f64 / total.as_secs_f64(),
    ));
    Ok(())
}

async fn pipelined<F, Fut>(
    name: &str,
    calls: u64,
    inflight: u64,
    call: F,
    out: &mut Vec<(String, f64)>,
) -> Result<(), String>
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let t0 = Instant::now();
    let mut running = FuturesUnordered::new();
    let mut next = 0;
    while next < calls.min(inflight) {
        running.push(call(next));
        next += 1;
    }
    while let Some(r) = running.next().await {
        r?;
        if next < calls {
            running.push(call(next));
            next += 1;
        }
    }
    out.push((
        format!("rpc.{name}.pipelined.calls_per_s"),
        calls as f64 / t0.elapsed().as_secs_f64(),
    ));
    Ok(())
}

/// Runs all three measurements and returns the figures in print order.
pub async fn run(args: &RpcArgs) -> Result<Vec<(String, f64)>, String> {
    let mut out = Vec::new();
    let (n, k) = (args.calls, args.inflight);

    let (raw, _) = ractor::Actor::spawn(None, RawEcho, ())
        .await
        .map_err(|e| format!("cannot start ractor actor: {e}"))?;
    let raw_call = |i: u64| {
        let raw = raw.clone();
        async move {
            match raw.call(|tx| (i, tx), None).await {
                Ok(ractor::rpc::CallResult::Success(_)) => Ok(()),
                Ok(other) => Err(format!("ractor call failed: {other:?}")),
                Err(e) => Err(format!("ractor call failed: {e}")),
            }
        }
    };
    sequential("ractor", n, raw_call, &mut out).await?;
    pipelined("ractor", n, k, raw_call, &mut out).await?;
    raw.stop(None);
    // The socket's own floor, beside which the remote paths are read.
    super::rpc_floor::measure(n, &mut out).await?;

    // Each cluster starts just before its measurement and is gone before the next starts,
    // so no idle host shares the machine with a measurement.
    for name in ["local", "remote", "remote_grpc"] {
        let cluster = match name {
            "local" => Cluster::in_process(1, 0).await,
            "remote" => Cluster::local_processes(1, 0).await,
            _ => {
                Cluster::builder()
                    .calls(CallTransport::Grpc)
                    .local_processes(1, 0)
                    .await
            }
        };
        let cluster = cluster.map_err(|e| format!("{name} cluster: {e}"))?;
        let h = cluster
            .host(0)
            .spawn::<Diag>("bench", &DiagArgs {})
            .await
            .map_err(|e| e.to_string())?;
        let call = |i: u64| {
            let f = h.call(Echo {
                seq: i,
                body: String::new(),
            });
            async move { f.await.map(|_| ()).map_err(|e| e.to_string()) }
        };
        sequential(name, n, call, &mut out).await?;
        pipelined(name, n, k, call, &mut out).await?;
        cluster.shutdown().await;
    }
    let figure = |v: &[(String, f64)], k: &str| v.iter().find(|(n, _)| n == k).map(|(_, x)| *x);
    for (ours, ratio) in [
        ("rpc.remote.seq.p50_us", "rpc.remote_vs_floor.seq.ratio"),
        (
            "rpc.remote_grpc.seq.p50_us",
            "rpc.remote_grpc_vs_floor.seq.ratio",
        ),
    ] {
        if let (Some(a), Some(b)) = (figure(&out, ours), figure(&out, "rpc.floor.seq.p50_us"))
            && b > 0.0
        {
            out.push((ratio.to_string(), a / b));
        }
    }
    if let Some(python) = &args.vs_ray {
        let ray = ray_figures(python, n, k).await?;
        let get = |v: &[(String, f64)], k: &str| v.iter().find(|(n, _)| n == k).map(|(_, x)| *x);
        for (ours, theirs, ratio) in [
            (
                "rpc.remote.seq.calls_per_s",
                "rpc.ray.seq.calls_per_s",
                "rpc.remote_vs_ray.seq.ratio",
            ),
            (
                "rpc.remote.pipelined.calls_per_s",
                "rpc.ray.pipelined.calls_per_s",
                "rpc.remote_vs_ray.pipelined.ratio",
            ),
        ] {
            if let (Some(a), Some(b)) = (get(&out, ours), get(&ray, theirs))
                && b > 0.0
            {
                out.push((ratio.to_string(), a / b));
            }
        }
        let at = out.len()
            - out
                .iter()
                .rev()
                .take_while(|(n, _)| n.contains("_vs_ray"))
                .count();
        out.splice(at..at, ray);
    }
    Ok(out)
}
