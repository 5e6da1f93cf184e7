//! `troupe`: the one binary's subcommands (host, serve, run, gateway, alloc, quantize, engine,
//! bench), each a thin layer over the library crates: flags in, a library call, a summary out.
//!
//! They live in the root package's library (not only in `main.rs`) so the workspace's
//! integration tests can call what the commands call (e.g. the chaos benchmark's core).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
pub mod agent_flags;
pub mod bench;
pub mod gateway;
pub mod host;
pub mod plan;
pub mod plot;
pub mod quantize;
pub mod run;
pub mod serve;

/// The `troupe` command line.
#[derive(Parser)]
#[command(
    name = "troupe",
    version,
    about = "Actor-based single-controller runtime for LLM RL post-training"
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run an actor host (one per node) until SIGTERM/SIGINT.
    Host(host::HostArgs),
    /// Parse an allocation mode and print the plan (and, with --hosts, the placement).
    Alloc(troupe_scheduler::preview::AllocArgs),
    /// Convert a BF16/F32 safetensors checkpoint to FP8 (e4m3, block-wise scales).
    Quantize(quantize::QuantizeArgs),
    /// Run the reference inference engine (speaks SGLang's HTTP protocol, PD included).
    Engine(Box<troupe_engine::EngineArgs>),
    /// The main job: asynchronous GRPO through PD rollout serving with weight sync every step.
    Run(run::RunArgs),
    /// Bring up rollout serving from a YAML config and print the gateway address.
    Serve(serve::ServeArgs),
    /// Troupe's PD-aware router and gateway alone, in front of servers started elsewhere.
    Gateway(Box<gateway::GatewayArgs>),
    /// Everything `troupe serve` would launch for a config, without starting anything.
    Plan(plan::PlanArgs),
    /// Benchmarks; each prints one line per figure.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Actor call cost: raw ractor, in-process host, host subprocess over gRPC.
    Rpc(bench::rpc::RpcArgs),
    /// Gateway overhead: closed-loop load through the gateway (or --target) vs backends directly.
    Gateway(bench::gateway::GatewayBenchArgs),
    /// Fault tolerance: load through an in-process PD deployment while a random server is
    /// killed every few seconds; counts requests sent, answered, retried and lost.
    Chaos(bench::chaos::ChaosArgs),
    /// GRPO-shaped rollouts (groups of samples per prompt) through an in-process deployment:
    /// round robin without a prefix cache vs cache-aware routing with one; PD vs regular.
    Rollout(bench::rollout::RolloutArgs),
    /// Multi-turn agent sessions (each turn's prompt the last one plus its output plus a tool
    /// result) through an in-process deployment, once per routing policy.
    Agent(bench::agent::AgentArgs),
    /// Controller scaling: bring-up, fan-out, weight update and host loss with many hosts
    /// and servers (real reference-engine processes on in-process hosts).
    Scale(bench::scale::ScaleArgs),
    /// Weight broadcast to 1..N in-process receivers: through the shared-memory ring (receivers
    /// on this machine) or, with --chain, the chained TCP transport used between machines.
    Broadcast {
        /// Receiver counts to measure, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        receivers: Vec<usize>,
        /// MiB of bf16 weights per run.
        #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
        mib: u64,
        /// Quantize to FP8 on the way (quantize time included).
        #[arg(long)]
        fp8: bool,
        /// Keep every receiver on the TCP chain (what engines on other machines use) instead of
        /// the shared-memory ring that engines on rank 0's machine read from.
        #[arg(long)]
        chain: bool,
        /// Size of the shared-memory ring in KiB.
        #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(64..=1048576))]
        ring_kib: u64,
        /// Measure full against delta syncs after optimizer steps that each changed this
        /// fraction of the BF16 values (e.g. 0.02), scattered over every tensor; the second
        /// step is timed, a training loop's steady state.
        #[arg(long)]
        changed: Option<f64>,
        /// With --changed and --chain: every receiver reads its link no faster than this many
        /// Gb/s, as between machines (on one machine a loopback link is a memory copy).
        #[arg(long)]
        link_gbps: Option<f64>,
        /// Print one JSON object instead of one line per figure.
        #[arg(long)]
        json: bool,
    },
    /// FP8 block quantization throughput of a 4096x14336 bf16 matrix, beside memcpy, and the
    /// kernel measured (`TROUPE_FP8_KERNEL=scalar|avx2|avx512` forces one).
    Fp8 {
        /// Print one JSON object instead of one line per figure.
        #[arg(long)]
        json: bool,
    },
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TROUPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Writes one result to standard output, ignoring a reader that went away (`troupe plan |
/// head`): `println!` would panic on the closed pipe.
pub(crate) fn out(text: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {}", troupe_wire::clip(&msg.to_string()));
    ExitCode::FAILURE
}

/// A benchmark's outcome: its figures printed (one line each, or JSON), or its error.
fn figures(r: Result<Vec<(String, f64)>, impl std::fmt::Display>, json: bool) -> ExitCode {
    match r {
        Ok(figs) => {
            bench::print_figures(&figs, json);
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// argv, with the SGLang flags `troupe engine` does not take left out (and named, once, on
/// stderr): one launch command or config serves both the reference engine and SGLang.
fn argv(all: Vec<String>) -> Vec<String> {
    if all.get(1).map(String::as_str) != Some("engine") {
        return all;
    }
    use clap::Args as _;
    let own: Vec<String> = troupe_engine::EngineArgs::augment_args(clap::Command::new("engine"))
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let (rest, ignored) = troupe_engine::foreign::split_foreign(&all[2..], &own);
    if !ignored.is_empty() {
        eprintln!(
            "warning: troupe engine ignores these SGLang flags: {}",
            ignored.join(" ")
        );
    }
    all[..2].iter().cloned().chain(rest).collect()
}

/// Parses argv and runs the chosen subcommand; the binary's whole `main`.
pub fn main() -> ExitCode {
    main_from(std::env::args().collect())
}

/// [`main`] with the arguments given (the first is the program name): what the Python wheel's
/// `troupe` script runs, in the Python process, so `pip install` brings the whole CLI.
pub fn main_from(args: Vec<String>) -> ExitCode {
    let cli = match Cli::try_parse_from(argv(args)) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_tracing();
    // An engine's HTTP side only parses, queues and answers (its scheduler thread does the
    // model work), so one I/O thread serves it, as one uvicorn loop serves SGLang's: with
    // hundreds of engines on a machine, a multi-thread runtime's worker wake-ups cost more CPU
    // than the requests themselves (`troupe bench scale`).
    let mut builder = match &cli.cmd {
        Cmd::Engine(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start the async runtime: {e}")),
    };
    match &cli.cmd {
        Cmd::Quantize(a) => {
            return match quantize::run(a) {
                Ok(summary) => {
                    out(&summary);
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            };
        }
        Cmd::Bench(BenchCmd::Fp8 { json }) => return bench::fp8::run(*json),
        _ => {}
    }
    if let Cmd::Plan(a) = &cli.cmd {
        // Pure computation: nothing starts.
        return match plan::run(a) {
            Ok(text) => {
                out(&text);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    if let Cmd::Alloc(a) = &cli.cmd {
        // Pure computation: no runtime. An invalid mode is a usage error (exit 2).
        return match troupe_scheduler::preview::run_alloc(a) {
            Ok(text) => {
                out(&text);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {}", troupe_wire::clip(&e.to_string()));
                ExitCode::from(2)
            }
        };
    }
    // The command runs as a task on the runtime's workers, not on this thread: a worker
    // that reads an actor's reply from its socket then resumes the caller itself, where the
    // `block_on` thread would have to be woken for every reply (a remote call's p50 here:
    // 31-42 µs from a task, 62-66 µs from `block_on`).
    let code = rt.block_on(async move {
        match tokio::spawn(run(cli.cmd)).await {
            Ok(code) => code,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => fail(format!("the command's task was cancelled: {e}")),
        }
    });
    // Server logs: removed after a clean run, kept (and named) after a failure.
    if let Some(dir) = troupe_serving::inference::rundir::finish(code == ExitCode::SUCCESS) {
        eprintln!("server logs kept in {}", dir.display());
    }
    code
}

/// Runs a subcommand that needs the async runtime.
async fn run(cmd: Cmd) -> ExitCode {
    match cmd {
        Cmd::Host(a) => match host::run(a).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::Alloc(_) | Cmd::Plan(_) | Cmd::Quantize(_) | Cmd::Bench(BenchCmd::Fp8 { .. }) => {
            ExitCode::SUCCESS // handled above, without a runtime
        }
        Cmd::Gateway(a) => match gateway::run(&a).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::Engine(a) => match troupe_engine::serve(*a).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::Run(a) => match run::run(&a).await {
            Ok(s) => {
                println!(
                    "done: {} steps in {:.1} s; reward {:.3} -> {:.3}; max staleness {}",
                    s.steps,
                    s.total_seconds,
                    s.baseline_reward,
                    s.final_reward,
                    s.max_staleness_seen
                );
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Cmd::Serve(a) => match serve::run(&a).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::Bench(BenchCmd::Broadcast {
            receivers,
            mib,
            fp8,
            chain,
            ring_kib,
            changed,
            link_gbps,
            json,
        }) => {
            if link_gbps.is_some() && (changed.is_none() || !chain) {
                return fail(
                    "--link-gbps models a link between machines: use it with --chain and --changed",
                );
            }
            if receivers.is_empty() || receivers.contains(&0) {
                return fail("--receivers takes positive counts, e.g. --receivers 1,2,4,8");
            }
            let ring = (!chain).then_some(ring_kib as usize * 1024);
            let figs = match changed {
                Some(f) => {
                    troupe_weights::broadcast_delta_bench::bench_broadcast_delta(
                        &receivers,
                        mib as usize,
                        fp8,
                        ring,
                        f,
                        link_gbps,
                    )
                    .await
                }
                None => {
                    troupe_weights::broadcast_bench::bench_broadcast(
                        &receivers,
                        mib as usize,
                        fp8,
                        ring,
                    )
                    .await
                }
            };
            figures(figs, json)
        }
        Cmd::Bench(BenchCmd::Gateway(a)) => figures(bench::gateway::run(&a).await, a.json),
        Cmd::Bench(BenchCmd::Rollout(a)) => figures(bench::rollout::run(&a).await, a.json),
        Cmd::Bench(BenchCmd::Agent(a)) => figures(bench::agent::run(&a).await, a.json),
        Cmd::Bench(BenchCmd::Scale(a)) => figures(bench::scale::run(&a).await, a.json),
        Cmd::Bench(BenchCmd::Chaos(a)) => figures(bench::chaos::run(&a).await, a.json),
        Cmd::Bench(BenchCmd::Rpc(a)) => figures(bench::rpc::run(&a).await, a.json),
    }
}

/// SIGTERM and SIGINT, listened to from creation on. A command creates one before it starts
/// anything and waits on it wherever it can be stopped: a signal that lands between two waits
/// (say while it prints its banner) is kept and ends the next wait. Tokio drops a signal that
/// arrives while no listener exists, and its handler replaces the default action, so a fresh
/// listener per wait lost such a signal and the command ran on.
pub struct Shutdown {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
}

impl Shutdown {
    /// Starts listening.
    pub fn listen() -> Shutdown {
        use tokio::signal::unix::{SignalKind, signal};
        Shutdown {
            term: signal(SignalKind::terminate()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
        }
    }

    /// Resolves on the first SIGTERM or SIGINT since [`Shutdown::listen`] not yet waited for.
    pub async fn wait(&mut self) {
        match (self.term.as_mut(), self.int.as_mut()) {
            (Some(t), Some(i)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}
