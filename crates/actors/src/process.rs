//! A child process that takes its whole process tree with it.
//!
//! Inference servers fork workers of their own (SGLang's scheduler and detokenizer, TP ranks).
//! Killing only the direct child leaves those holding GPUs and ports, so every child starts as
//! the leader of its own process group and is stopped by signalling the group.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// A running child process in its own process group; killed (whole group) on drop.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    pid: u32,
    done: Option<ExitStatus>,
}

impl ChildProcess {
    /// Spawns `cmd` as a new process-group leader. With `log`, stdout and stderr go to that file
    /// (appended; created mode 0600, since a server's log holds prompts and errors that other
    /// users of the machine must not read); otherwise they are inherited.
    ///
    /// The child dies with this process however it dies (on Linux, `PR_SET_PDEATHSIG` =
    /// SIGKILL: a SIGKILLed `troupe serve` or `troupe host` leaves no engine behind), and it
    /// does not inherit the control-plane token (`TROUPE_TOKEN`), which is the host's secret.
    pub fn spawn(mut cmd: Command, log: Option<&Path>) -> std::io::Result<ChildProcess> {
        cmd.process_group(0)
            .stdin(Stdio::null())
            .env_remove(crate::auth::TOKEN_ENV);
        die_with_parent(&mut cmd);
        if let Some(p) = log {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(p)?;
            cmd.stdout(f.try_clone()?).stderr(f);
        }
        let child = cmd.spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| std::io::Error::other("child exited before its pid was read"))?;
        Ok(ChildProcess {
            child,
            pid,
            done: None,
        })
    }

    /// Takes the child's stdout pipe, if it was spawned with `Stdio::piped()`.
    pub fn take_stdout(&mut self) -> Option<tokio::process::ChildStdout> {
        self.child.stdout.take()
    }

    /// The child's pid (also its process-group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Exit status if the child has exited, without waiting.
    pub fn try_status(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.done.is_none() {
            self.done = self.child.try_wait()?;
        }
        Ok(self.done)
    }

    /// Waits for the child to exit on its own.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(s) = self.done {
            return Ok(s);
        }
        let s = self.child.wait().await?;
        self.done = Some(s);
        Ok(s)
    }

    /// Sends `sig` to the whole process group.
    pub fn signal(&self, sig: Signal) -> nix::Result<()> {
        killpg(Pid::from_raw(self.pid as i32), sig)
    }

    /// SIGTERM to the group, up to `grace` to exit, then SIGKILL to the group.
    pub async fn terminate(&mut self, grace: Duration) -> std::io::Result<ExitStatus> {
        if let Some(s) = self.try_status()? {
            let _ = self.signal(Signal::SIGKILL); // stragglers of an exited leader
            return Ok(s);
        }
        let _ = self.signal(Signal::SIGTERM);
        if let Ok(r) = tokio::time::timeout(grace, self.child.wait()).await {
            let s = r?;
            self.done = Some(s);
            let _ = self.signal(Signal::SIGKILL);
            return Ok(s);
        }
        let _ = self.signal(Signal::SIGKILL);
        self.wait().await
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        // Whatever path got us here (kill, panic, shutdown), leave no process behind.
        let _ = self.signal(Signal::SIGKILL);
        let _ = self.child.start_kill();
    }
}

/// Watches a child an actor owns: when it exits on its own (not because `stopping` was
/// cancelled first, as an actor's `stopping` does before terminating it), `on_exit` runs with
/// the exit status, typically failing the actor so its restart policy applies. One mechanism for
/// every actor that owns a process (inference servers, Python workers).
pub fn watch_exit(
    child: std::sync::Arc<tokio::sync::Mutex<ChildProcess>>,
    stopping: tokio_util::sync::CancellationToken,
    on_exit: impl FnOnce(std::io::Result<ExitStatus>) + Send + 'static,
) {
    tokio::spawn(async move {
        let status = {
            let mut c = child.lock().await;
            tokio::select! {
                _ = stopping.cancelled() => return,
                s = c.wait() => s,
            }
        };
        if !stopping.is_cancelled() {
            on_exit(status);
        }
    });
}

/// Makes the child get SIGKILL when the thread that spawned it dies (Linux; elsewhere a no-op).
/// Spawning happens on the runtime's long-lived worker threads, so in practice that is when
/// this process dies. If the parent is already gone by the time the child runs, it exits.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec and calls only prctl(2) and
    // getppid(2), which are async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            if nix::unistd::getppid() != parent {
                // The parent exited before the child started (no allocation after fork).
                return Err(std::io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// The `troupe` executable a process embedding Troupe says it has (the Python package: the
/// `troupe` script its wheel installs beside the interpreter); `TROUPE_BIN` still wins.
static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Tells [`troupe_binary`] where this process's `troupe` executable is (first call wins).
pub fn set_troupe_binary(path: PathBuf) {
    let _ = BINARY.set(path);
}

/// Finds the `troupe` binary: `$TROUPE_BIN`, the one set by [`set_troupe_binary`], this
/// executable if it is `troupe`, or a `troupe` next to (or one directory above) this
/// executable, which is where cargo puts it for tests, else a `troupe` on `PATH`.
///
/// Hosts and InferenceServers start `troupe host` / `troupe engine` children; inside a test
/// binary the current executable is not `troupe`, so this is how they find the real one.
pub fn troupe_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("TROUPE_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = BINARY.get() {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate this executable: {e}"))?;
    if exe.file_stem().is_some_and(|s| s == "troupe") {
        return Ok(exe);
    }
    let mut dir = exe.parent();
    for _ in 0..2 {
        if let Some(d) = dir {
            let cand = d.join("troupe");
            if cand.is_file() {
                return Ok(cand);
            }
            dir = d.parent();
        }
    }
    // A host embedded elsewhere (the Python bindings: the executable is python) finds the
    // installed binary (`cargo install --path .`) on PATH.
    if let Some(p) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("troupe"))
        .find(|c| c.is_file())
    {
        return Ok(p);
    }
    Err(
        "cannot find the `troupe` binary: build it (`cargo build`), install it (`cargo install --path .`: on PATH) or set TROUPE_BIN"
            .into(),
    )
}
