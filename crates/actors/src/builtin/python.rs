//! `troupe.python`: a Python object living in a worker process on a host, owned by an actor.
//!
//! Ray and Monarch let a single controller place Python classes on remote machines and call
//! them; this is Troupe's way, under the host's own guarantees. The actor starts
//! `python -m troupe._worker` (the interpreter its arguments name) as its child, in its own
//! process group, and talks to it over a socket pair (the child's fd 3) in length-prefixed
//! MessagePack frames ([`super::python_wire`]). The worker imports the class, builds the
//! object and then runs one method call per request: a plain method to its end before it reads
//! the next request, an `async def` method as a task on the worker's one event loop, so several
//! of those run concurrently when several calls are in flight to it.
//!
//! This actor handles one message at a time (the host's mailbox), so today it has one call in
//! flight to its worker: calls start and finish in the order they reached the actor, async
//! ones included. The frames carry call ids so that a worker can answer several calls in any
//! order once the actor may leave a call in flight while taking the next; that needs the
//! runtime to let a handler reply after it returns, which it does not yet.
//!
//! What the host gives it for free: calls are ordered (one mailbox), the worker dies with the
//! host, stopping the actor kills the worker's process group, and a worker that exits makes the
//! actor fail so its restart policy applies (a fresh worker, the same constructor arguments).
//! The call in flight when a worker dies is answered at once with [`PyOutcome::Died`]; a
//! Python exception in a method is answered with [`PyOutcome::Raised`] and the worker stays.
//!
//! Payloads are opaque here: the Python side encodes arguments and results (MessagePack with
//! numpy arrays as raw buffers; pickle only when asked).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::python_wire::{
    Answer, Call, Hello, Raised, Reply, read_frame, split_target, write_frame,
};
use crate::actor::{Actor, ActorContext, Handler, Message, Methods};
use crate::error::ActorError;
use crate::process::ChildProcess;

/// Environment variable naming the worker's end of the socket pair (defined with the frames).
pub use super::python_wire::FD_ENV;

/// Arguments of `troupe.python` (kept for restarts: a restarted worker is built the same way).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PyWorkerArgs {
    /// The Python interpreter (`python.executable`; the controller's own by default).
    pub python: String,
    /// The class, as `package.module:QualName` (checked by [`split_target`] before a worker
    /// is started).
    pub target: String,
    /// The file to load as the class's module when it was defined in the controller's
    /// `__main__` script (loaded as `__mp_main__`, as multiprocessing does).
    #[serde(default)]
    pub main_file: Option<String>,
    /// Entries put first on the worker's `sys.path` (the controller script's directory).
    #[serde(default)]
    pub sys_path: Vec<String>,
    /// The constructor's `(args, kwargs)`, encoded by the Python side.
    #[serde(with = "serde_bytes")]
    pub init: Vec<u8>,
    /// Extra environment (the torchrun variables of an SPMD group).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// GPUs the worker may use, as `CUDA_VISIBLE_DEVICES` (empty: none, hidden).
    #[serde(default)]
    pub gpus: Vec<u32>,
    /// Seconds the worker may take to import the class and build the object.
    #[serde(default = "start_timeout")]
    pub start_timeout_s: f64,
}

fn start_timeout() -> f64 {
    120.0
}

/// One method call: `method` with its encoded `(args, kwargs)`; sent to the worker as a
/// numbered [`Call`], its arguments not copied.
pub use super::python_wire::Request as PyCall;

/// How a call ended. Any of these is a successful RPC: the caller decides what to raise.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PyOutcome {
    /// The method returned; its encoded result.
    Ok(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The method raised; the worker keeps running.
    Raised(Raised),
    /// The worker process died during the call (the actor restarts or stops per its policy).
    Died(String),
}

impl Message for PyCall {
    type Reply = PyOutcome;
    const METHOD: &'static str = "py_call";
}

/// Asks about the worker process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PyInfo;

/// Reply to [`PyInfo`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PyWorkerInfo {
    /// The worker's pid (its process group too).
    pub pid: u32,
    /// The environment Troupe set for it.
    pub env: BTreeMap<String, String>,
    /// How many times the actor (and so the worker) was restarted.
    pub restarts: u32,
}

impl Message for PyInfo {
    type Reply = PyWorkerInfo;
    const METHOD: &'static str = "py_info";
}

/// The actor: the worker process and the socket to it.
pub struct PyWorker {
    child: Arc<tokio::sync::Mutex<ChildProcess>>,
    sock: UnixStream,
    info: PyWorkerInfo,
    stopping: CancellationToken,
    /// The id of the last call sent to the worker.
    last_call: u64,
}

impl PyWorker {
    /// Why the worker is gone, once its exit status is known (briefly waited for).
    async fn death(&self) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            // The exit watcher holds the lock while it waits; it lets go once the worker exited.
            if let Ok(mut c) = self.child.try_lock()
                && let Ok(Some(s)) = c.try_status()
            {
                return format!("the python worker (pid {}) exited ({s})", self.info.pid);
            }
            if tokio::time::Instant::now() >= deadline {
                return format!(
                    "the python worker (pid {}) closed its socket",
                    self.info.pid
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Actor for PyWorker {
    const KIND: &'static str = "troupe.python";
    type Args = PyWorkerArgs;

    async fn start(a: PyWorkerArgs, ctx: &ActorContext) -> Result<Self, ActorError> {
        if !(a.start_timeout_s.is_finite() && a.start_timeout_s > 0.0) {
            return Err(ActorError::new("start_timeout_s must be a positive number"));
        }
        if split_target(&a.target).is_none() {
            return Err(ActorError::new(format!(
                "{:?} is not an import path like 'package.module:Class'",
                a.target
            )));
        }
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let child_fd = theirs.as_raw_fd();
        let mut cmd = Command::new(&a.python);
        cmd.args(["-u", "-m", "troupe._worker"])
            .envs(&a.env)
            .env(FD_ENV, "3")
            .env(
                "CUDA_VISIBLE_DEVICES",
                a.gpus
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            )
            // The host's stdout may be a pipe nobody reads; worker output goes to stderr.
            .stdout(std::process::Stdio::from(std::io::stderr()));
        // SAFETY: dup2 and fcntl are async-signal-safe; nothing is allocated after fork.
        unsafe {
            cmd.pre_exec(move || {
                use nix::libc;
                let ok = if child_fd == 3 {
                    // Already in place: only let it survive exec.
                    let flags = libc::fcntl(child_fd, libc::F_GETFD);
                    flags >= 0
                        && libc::fcntl(child_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) >= 0
                } else {
                    libc::dup2(child_fd, 3) >= 0
                };
                if ok {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let child = ChildProcess::spawn(cmd, None).map_err(|e| {
            ActorError::new(format!(
                "cannot start the python worker with {:?}: {e} (set python.executable to an interpreter with the troupe package)",
                a.python
            ))
        })?;
        drop(theirs);
        ours.set_nonblocking(true)?;
        let mut sock = UnixStream::from_std(ours)?;
        let pid = child.pid();
        let hello = Hello {
            target: a.target.clone(),
            main_file: a.main_file.clone(),
            sys_path: a.sys_path.clone(),
            init: a.init.clone(),
        };
        let handshake = async {
            write_frame(&mut sock, &hello).await?;
            read_frame::<Reply>(&mut sock).await
        };
        let timeout = Duration::from_secs_f64(a.start_timeout_s.min(86_400.0));
        let child = Arc::new(tokio::sync::Mutex::new(child));
        let reply = match tokio::time::timeout(timeout, handshake).await {
            Err(_) => {
                return Err(ActorError::new(format!(
                    "the python worker did not build {} within {:.0} s",
                    a.target, a.start_timeout_s
                )));
            }
            Ok(Err(e)) => {
                // It closed the socket: normally it is exiting (give it a moment to say how).
                let wait = async { child.lock().await.wait().await.ok() };
                let status = tokio::time::timeout(Duration::from_secs(2), wait)
                    .await
                    .ok()
                    .flatten();
                return Err(ActorError::new(format!(
                    "the python worker for {} exited during start ({}): {e}; is the troupe package installed for {:?}?",
                    a.target,
                    status.map_or("unknown status".into(), |s| s.to_string()),
                    a.python
                )));
            }
            Ok(Ok(r)) => r,
        };
        if let Reply::Raised(r) = reply {
            return Err(ActorError::new(format!(
                "cannot build {}: {}: {}\n{}",
                a.target, r.kind, r.message, r.traceback
            )));
        }
        let stopping = CancellationToken::new();
        let fail = ctx.fail_handle();
        crate::process::watch_exit(child.clone(), stopping.clone(), move |status| {
            let why = match status {
                Ok(s) => format!("the python worker exited ({s})"),
                Err(e) => format!("the python worker cannot be waited on: {e}"),
            };
            if let Some(f) = fail {
                f.fail(why);
            }
        });
        Ok(PyWorker {
            child,
            sock,
            info: PyWorkerInfo {
                pid,
                env: a.env,
                restarts: ctx.restarts,
            },
            stopping,
            last_call: 0,
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<PyCall>().add::<PyInfo>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        self.stopping.cancel();
        let _ = self
            .child
            .lock()
            .await
            .terminate(Duration::from_secs(5))
            .await;
    }
}

impl Handler<PyCall> for PyWorker {
    async fn handle(&mut self, msg: PyCall, ctx: &ActorContext) -> Result<PyOutcome, ActorError> {
        self.last_call += 1;
        let id = self.last_call;
        let call = Call {
            id,
            method: &msg.method,
            args: &msg.args,
        };
        let answer = async {
            write_frame(&mut self.sock, &call).await?;
            read_frame::<Answer>(&mut self.sock).await
        }
        .await;
        Ok(match answer {
            Ok(Answer { id: got, reply }) if got == id => match reply {
                Reply::Ok(b) => PyOutcome::Ok(b),
                Reply::Raised(r) => PyOutcome::Raised(r),
            },
            Ok(Answer { id: got, .. }) => {
                // Only one call is ever in flight: the worker is broken. A fresh one is the cure.
                let why = format!(
                    "the python worker (pid {}) answered call {got} while call {id} was waiting",
                    self.info.pid
                );
                if let Some(f) = ctx.fail_handle() {
                    f.fail(why.clone());
                }
                PyOutcome::Died(why)
            }
            Err(_) => PyOutcome::Died(self.death().await),
        })
    }
}

impl Handler<PyInfo> for PyWorker {
    async fn handle(&mut self, _: PyInfo, _ctx: &ActorContext) -> Result<PyWorkerInfo, ActorError> {
        Ok(self.info.clone())
    }
}
