//! `troupe.process`: run a command on a host, owned by an actor.
//!
//! The actor owns the child's whole process group: stopping the actor, killing it, or shutting
//! the host down kills the tree. If the command exits on its own the actor stays up and reports
//! the exit status (a supervisor of servers decides what that means).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use tokio::process::Command;

use crate::actor::{Actor, ActorContext, Handler, Message, Methods};
use crate::error::ActorError;
use crate::process::ChildProcess;

/// Arguments of `troupe.process`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessArgs {
    /// Program to run (looked up on PATH).
    pub program: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// File that receives stdout and stderr (appended).
    #[serde(default)]
    pub log: Option<PathBuf>,
    /// Grace between SIGTERM and SIGKILL when the actor stops, in milliseconds.
    #[serde(default)]
    pub term_grace_ms: Option<u64>,
}

/// The process actor.
pub struct Process {
    child: ChildProcess,
    grace: Duration,
}

/// Asks for the child's pid (its process-group id too).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pid;

impl Message for Pid {
    type Reply = u32;
    const METHOD: &'static str = "pid";
}

/// Asks whether the child still runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status;

/// Reply to [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// True while the child has not exited.
    pub running: bool,
    /// Exit code once exited (None if killed by a signal or still running).
    pub exit_code: Option<i32>,
}

impl Message for Status {
    type Reply = ProcessStatus;
    const METHOD: &'static str = "status";
}

/// Sends a signal (by number, e.g. 15 for SIGTERM) to the child's process group.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SignalProcess {
    /// Signal number.
    pub signal: i32,
}

impl Message for SignalProcess {
    type Reply = ();
    const METHOD: &'static str = "signal";
}

impl Actor for Process {
    const KIND: &'static str = "troupe.process";
    type Args = ProcessArgs;

    async fn start(a: ProcessArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        if a.program.is_empty() {
            return Err(ActorError::new(
                "troupe.process needs a program, e.g. {\"program\": \"sleep\", \"args\": [\"10\"]}",
            ));
        }
        let mut cmd = Command::new(&a.program);
        cmd.args(&a.args).envs(&a.env);
        if let Some(d) = &a.cwd {
            cmd.current_dir(d);
        }
        let child = ChildProcess::spawn(cmd, a.log.as_deref())
            .map_err(|e| ActorError::new(format!("cannot start {:?}: {e}", a.program)))?;
        Ok(Process {
            child,
            grace: Duration::from_millis(a.term_grace_ms.unwrap_or(5_000)),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<Pid>().add::<Status>().add::<SignalProcess>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        let _ = self.child.terminate(self.grace).await;
    }
}

impl Handler<Pid> for Process {
    async fn handle(&mut self, _m: Pid, _ctx: &ActorContext) -> Result<u32, ActorError> {
        Ok(self.child.pid())
    }
}

impl Handler<Status> for Process {
    async fn handle(
        &mut self,
        _m: Status,
        _ctx: &ActorContext,
    ) -> Result<ProcessStatus, ActorError> {
        let s = self.child.try_status()?;
        Ok(ProcessStatus {
            running: s.is_none(),
            exit_code: s.and_then(|s| s.code()),
        })
    }
}

impl Handler<SignalProcess> for Process {
    async fn handle(&mut self, m: SignalProcess, _ctx: &ActorContext) -> Result<(), ActorError> {
        let sig = Signal::try_from(m.signal)
            .map_err(|_| ActorError::new(format!("{} is not a valid signal number", m.signal)))?;
        self.child
            .signal(sig)
            .map_err(|e| ActorError::new(format!("cannot signal pid {}: {e}", self.child.pid())))
    }
}
