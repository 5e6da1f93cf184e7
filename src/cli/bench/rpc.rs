//! `troupe bench rpc`: what an actor call costs, from raw ractor up to a call over loopback gRPC.
//!
//! Three paths, same work (an echo): (a) a bare ractor `call`, the floor; (b) a typed handle to
//! an actor on an in-process host; (c) a typed handle to an actor on a `troupe host` subprocess.
//! Each is measured sequentially (latency percentiles and calls/s) and pipelined with a fixed
//! number of calls in flight (calls/s).

use std::future::Future;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use troupe_actors::builtin::diag::{Diag, DiagArgs, Echo};

use troupe_controller::Cluster;

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

async fn sequential<F, Fut>(
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

    for (name, cluster) in [
        ("local", Cluster::in_process(1, 0).await),
        ("remote", Cluster::local_processes(1, 0).await),
    ] {
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
    Ok(out)
}
