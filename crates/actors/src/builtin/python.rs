//! `troupe.python`: a Python object living in a worker process on a host, owned by an actor.
//!
//! Ray and Monarch let a single controller place Python classes on remote machines and call
//! them; this is Troupe's way, under the host's own guarantees. The actor starts
//! `python -m troupe._worker` (the interpreter its arguments name) as its child, in its own
//! process group, and talks to it over a socket pair (the child's fd 3) in length-prefixed
//! MessagePack frames ([`super::python_wire`]).
//!
//! How calls run. The actor takes one message at a time (the host's mailbox) and writes each
//! call to the worker as a numbered [`Call`] in that order, without waiting for its answer
//! ([`PyCall`] is a [`DeferredHandler`]): the call waits in a table of calls in flight, and a
//! task reading the worker's socket hands each [`Answer`] to the caller whose call has its id.
//! The worker starts calls in the order they arrive: a plain method runs to its end before it
//! reads the next call, an `async def` method becomes a task on the worker's one event loop and
//! runs concurrently with the calls after it. So calls from one caller start in the order that
//! caller made them, plain methods run one at a time in that order, and async methods overlap
//! (and may answer in any order).
//!
//! What the host gives it for free: calls are ordered (one mailbox), the worker dies with the
//! host, stopping the actor kills the worker's process group, and a worker that exits makes the
//! actor fail so its restart policy applies (a fresh worker, the same constructor arguments).
//! Every call in flight when a worker dies (or the actor stops) is answered at once with
//! [`PyOutcome::Died`]; a Python exception in a method is answered with [`PyOutcome::Raised`]
//! and the worker stays.
//!
//! Payloads are opaque here: the Python side encodes arguments and results (MessagePack with
//! numpy arrays as raw buffers; pickle only when asked).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::python_wire::{
    Answer, Call, Hello, Raised, Reply, read_frame, split_target, write_frame,
};
use crate::actor::{
    Actor, ActorContext, DeferredHandler, FailHandle, Handler, Message, Methods, Reply as CallReply,
};
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

/// The actor: the worker process, the socket's write half, and the calls in flight to it.
pub struct PyWorker {
    child: Arc<tokio::sync::Mutex<ChildProcess>>,
    /// Calls go out here, in the order the actor takes them.
    sock: OwnedWriteHalf,
    /// Calls written and not answered yet, shared with the task reading answers.
    calls: Arc<InFlight>,
    info: PyWorkerInfo,
    stopping: CancellationToken,
    /// The id of the last call sent to the worker.
    last_call: u64,
}

/// The calls in flight to one worker: the actor adds each before writing it, the answer reader
/// ([`read_answers`]) takes it out when its answer comes, or answers all of them
/// [`PyOutcome::Died`] once the worker is gone, so no caller waits on a dead worker.
#[derive(Default)]
struct InFlight(parking_lot::Mutex<InFlightState>);

#[derive(Default)]
struct InFlightState {
    waiting: HashMap<u64, CallReply<PyOutcome>>,
    /// Why the worker answers no more calls, once the reader has seen it gone.
    gone: Option<String>,
    /// The worker's exit status, as its exit watcher saw it (kept for the calls' error).
    exited: Option<String>,
}

impl InFlight {
    /// Records call `id` as waiting for its answer; gives `reply` back with the reason when the
    /// worker is already gone.
    fn wait_for(
        &self,
        id: u64,
        reply: CallReply<PyOutcome>,
    ) -> Result<(), (CallReply<PyOutcome>, String)> {
        let mut st = self.0.lock();
        match &st.gone {
            Some(why) => Err((reply, why.clone())),
            None => {
                st.waiting.insert(id, reply);
                Ok(())
            }
        }
    }

    /// Takes call `id` out (answered, or never sent).
    fn take(&self, id: u64) -> Option<CallReply<PyOutcome>> {
        self.0.lock().waiting.remove(&id)
    }

    /// Marks the worker gone for `why` and answers every call still waiting.
    fn close(&self, why: &str) {
        let waiting = {
            let mut st = self.0.lock();
            st.gone = Some(why.to_string());
            std::mem::take(&mut st.waiting)
        };
        for reply in waiting.into_values() {
            reply.send(Ok(PyOutcome::Died(why.to_string())));
        }
    }

    fn exited(&self) -> Option<String> {
        self.0.lock().exited.clone()
    }
}

/// Why the worker `pid` is gone, once its exit status is known (briefly waited for). The child is
/// held weakly: the actor's drop must still kill it.
async fn death(
    pid: u32,
    child: &Weak<tokio::sync::Mutex<ChildProcess>>,
    calls: &InFlight,
) -> String {
    let exited = |s: &dyn std::fmt::Display| format!("the python worker (pid {pid}) exited ({s})");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let Some(child) = child.upgrade() else {
            // The actor is gone; its exit watcher recorded the status if it saw the exit first.
            return match calls.exited() {
                Some(s) => exited(&s),
                None => format!("the python worker (pid {pid}) was stopped with its actor"),
            };
        };
        // The exit watcher holds the lock while it waits; it lets go once the worker exited.
        if let Ok(mut c) = child.try_lock()
            && let Ok(Some(s)) = c.try_status()
        {
            return exited(&s);
        }
        drop(child);
        if let Some(s) = calls.exited() {
            return exited(&s);
        }
        if tokio::time::Instant::now() >= deadline {
            return format!("the python worker (pid {pid}) closed its socket");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads the worker's answers and hands each to its caller until the worker is gone; then
/// answers every call still waiting and, unless the actor is stopping, fails the actor so its
/// restart policy applies (a worker that exited is also reported by its exit watcher; the first
/// report counts).
async fn read_answers(
    mut from: OwnedReadHalf,
    calls: Arc<InFlight>,
    child: Weak<tokio::sync::Mutex<ChildProcess>>,
    pid: u32,
    stopping: CancellationToken,
    fail: Option<FailHandle>,
) {
    let why = loop {
        match read_frame::<Answer>(&mut from).await {
            Ok(Answer { id, reply }) => match calls.take(id) {
                Some(caller) => caller.send(Ok(match reply {
                    Reply::Ok(b) => PyOutcome::Ok(b),
                    Reply::Raised(r) => PyOutcome::Raised(r),
                })),
                // The worker is broken; a fresh one is the cure.
                None => {
                    break format!(
                        "the python worker (pid {pid}) answered call {id}, which was not waiting"
                    );
                }
            },
            Err(_) => break death(pid, &child, &calls).await,
        }
    };
    if !stopping.is_cancelled()
        && let Some(f) = fail
    {
        f.fail(why.clone());
    }
    calls.close(&why);
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
        let calls = Arc::new(InFlight::default());
        let fail = ctx.fail_handle();
        let note = calls.clone();
        crate::process::watch_exit(child.clone(), stopping.clone(), move |status| {
            let why = match status {
                Ok(s) => {
                    // Before the actor fails (and drops the child): the calls' error names it.
                    note.0.lock().exited = Some(s.to_string());
                    format!("the python worker exited ({s})")
                }
                Err(e) => format!("the python worker cannot be waited on: {e}"),
            };
            if let Some(f) = fail {
                f.fail(why);
            }
        });
        let (answers, sock) = sock.into_split();
        tokio::spawn(read_answers(
            answers,
            calls.clone(),
            Arc::downgrade(&child),
            pid,
            stopping.clone(),
            ctx.fail_handle(),
        ));
        Ok(PyWorker {
            child,
            sock,
            calls,
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
        m.add_deferred::<PyCall>().add::<PyInfo>();
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

/// Writes the call now (so calls reach the worker in the order the actor took them) and leaves
/// its answer to the task reading answers: the actor takes its next message without waiting
/// for it.
impl DeferredHandler<PyCall> for PyWorker {
    async fn handle_deferred(
        &mut self,
        msg: PyCall,
        reply: CallReply<PyOutcome>,
        _ctx: &ActorContext,
    ) {
        self.last_call += 1;
        let id = self.last_call;
        // Waiting before it is written: the answer may come before the write returns.
        if let Err((reply, why)) = self.calls.wait_for(id, reply) {
            return reply.send(Ok(PyOutcome::Died(why)));
        }
        let call = Call {
            id,
            method: &msg.method,
            args: &msg.args,
        };
        if write_frame(&mut self.sock, &call).await.is_err()
            && let Some(reply) = self.calls.take(id)
        {
            let why = death(self.info.pid, &Arc::downgrade(&self.child), &self.calls).await;
            reply.send(Ok(PyOutcome::Died(why)));
        }
    }
}

impl Handler<PyInfo> for PyWorker {
    async fn handle(&mut self, _: PyInfo, _ctx: &ActorContext) -> Result<PyWorkerInfo, ActorError> {
        Ok(self.info.clone())
    }
}
