//! Troupe's reference inference engine: a real (small) transformer on CPU that speaks SGLang's
//! HTTP protocol, including prefill/decode disaggregation with a TCP KV handoff, so the whole
//! system runs on a laptop and in CI and our router, controller and weight sync are exercised
//! against a real engine. It also serves vLLM's RL routes (pause / sleep / the four-phase
//! weight transfer / `/collective_rpc`, `/tokenize`, `/inference/v1/generate`) over the same
//! operations, so clients of both dialects run against it.
//!
//! - [`model`]: the transformer, its weights and KV cache (reusable by a trainer).
//! - [`sampling`]: sampling parameters and the deterministic sampler.
//! - [`core`]: requests and the continuous-batching scheduler thread.
//! - [`pd`]: the bootstrap listener, room store and KV wire format.
//! - [`server`]: the HTTP endpoints.
//! - [`config`]: [`EngineArgs`], the engine's settings (with the `cli` feature, also the
//!   `troupe engine` flags).
//! - [`train`]: a GRPO trainer for the reference model (full backprop, Adam).
//!
//! Entry points: [`serve`] for the binary, [`start`] for in-process use (tests, embedded runs).

#![warn(missing_docs)]

pub mod config;
pub mod core;
pub mod error;
pub mod foreign;
pub mod hf_tokenizer;
pub mod kernels;
pub mod model;
pub mod pd;
pub mod rng;
pub mod sampling;
pub mod server;
pub mod tokenizer;
pub mod train;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use config::{DisaggMode, EngineArgs};
pub use error::EngineError;
pub use model::{KvCache, ModelConfig, Tensor, Weights};

use crate::core::{EngineCore, SchedulerConfig};
use crate::pd::{BootstrapServer, RoomStore};
use crate::server::AppState;

/// A running engine started with [`start`].
#[derive(Debug)]
pub struct EngineHandle {
    addr: SocketAddr,
    bootstrap: Option<BootstrapServer>,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
    core: EngineCore,
}

impl EngineHandle {
    /// The HTTP address actually bound (useful with `--port 0`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port` of this engine.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound KV bootstrap port on a prefill server (`None` on regular and decode servers,
    /// which do not listen).
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.bootstrap.as_ref().map(|b| b.addr().port())
    }

    /// Stops accepting, lets open responses finish, aborts what is still queued, and waits
    /// for the server task.
    pub async fn shutdown(mut self) -> Result<(), EngineError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.core.shutdown();
        self.bootstrap = None;
        match self.server.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(EngineError::Serve {
                addr: self.addr,
                source,
            }),
            Err(e) => Err(EngineError::Io(std::io::Error::other(e))),
        }
    }
}

async fn bind(host: &str, port: u16) -> Result<TcpListener, EngineError> {
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    TcpListener::bind(&addr)
        .await
        .map_err(|source| EngineError::Bind { addr, source })
}

/// Starts an engine in this process: validates flags, loads or initialises weights, starts
/// the scheduler thread, binds the HTTP port (and the bootstrap port on a prefill server).
/// Returns once both sockets accept connections.
pub async fn start(args: EngineArgs) -> Result<EngineHandle, EngineError> {
    let v = args.validate()?;
    let weights = match &args.model_path {
        Some(p) => {
            let (config, path) = (v.config.clone(), p.clone());
            tokio::task::spawn_blocking(move || Weights::load_safetensors(&config, &path))
                .await
                .map_err(|e| EngineError::Weights(e.to_string()))??
        }
        None => Weights::init(&v.config, args.random_seed),
    };
    if args.sim_startup_delay_s > 0.0 {
        tokio::time::sleep(std::time::Duration::from_secs_f64(args.sim_startup_delay_s)).await;
    }
    let listener = bind(&args.host, args.port).await?;
    let addr = listener.local_addr()?;
    let (rooms, bootstrap) = if v.mode == DisaggMode::Prefill {
        let store = RoomStore::new(v.prefill_keep);
        let bl = bind(&args.host, args.disaggregation_bootstrap_port).await?;
        let server =
            BootstrapServer::spawn(bl, store.clone(), v.prefill_keep, args.bootstrap_secret())?;
        (Some(store), Some(server))
    } else {
        (None, None)
    };
    let core = EngineCore::start(
        weights,
        SchedulerConfig {
            max_running: args.max_running_requests,
            latency: v.latency,
            weight_version: args.weight_version.clone(),
            prefix_cache_tokens: (!args.disable_radix_cache)
                .then(|| args.kv_pool_tokens(&v.config)),
        },
        rooms.clone(),
    )?;
    let state = Arc::new(AppState {
        config: v.config.clone(),
        mode: v.mode,
        core: core.clone(),
        counter: AtomicU64::new(0),
        kv_timeout: v.kv_timeout,
        weights_timeout: v.weights_timeout,
        bootstrap_port: bootstrap.as_ref().map(|b| b.addr().port()),
        rooms,
        groups: tokio::sync::Mutex::new(HashMap::new()),
        weight_bases: troupe_weights::delta::ReceiverBases::shared(),
        addr,
        args,
        vllm: Default::default(),
    });
    let app = server::router(state);
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener.tap_io(server::keep_alive::accepted), app)
            .with_graceful_shutdown(async {
                let _ = rx.await;
            })
            .await
    });
    tracing::info!(%addr, mode = v.mode.as_str(), model = %v.config.name, "engine started");
    Ok(EngineHandle {
        addr,
        bootstrap,
        shutdown: Some(tx),
        server,
        core,
    })
}

async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs `troupe engine`: starts the engine, prints `engine listening on <addr>` to stdout once
/// it accepts connections, and serves until SIGINT or SIGTERM.
pub async fn serve(args: EngineArgs) -> Result<(), EngineError> {
    let handle = start(args).await?;
    println!("engine listening on {}", handle.addr());
    if let Some(port) = handle.bootstrap_port() {
        tracing::info!(port, "KV bootstrap listening");
    }
    tokio::select! {
        _ = termination() => {}
        // A zombie whose HTTP side still answers must not keep a port and a place in the router.
        _ = handle.core.stopped() => {
            tracing::error!("the scheduler thread stopped: exiting so the engine is restarted");
            let _ = handle.shutdown().await;
            return Err(EngineError::SchedulerStopped);
        }
    }
    tracing::info!("shutting down");
    handle.shutdown().await
}
