//! `troupe host` child processes on this machine.
//!
//! The controller starts each with `--listen 127.0.0.1:0` and learns its address from the one
//! line the host prints when it is ready, so no port is ever guessed.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use troupe_actors::process::ChildProcess;

/// The line a ready host prints on stdout, followed by its address.
pub const READY_PREFIX: &str = "host listening on ";

pub use troupe_actors::process::troupe_binary;

/// A `troupe host` process this controller started.
pub(crate) struct LocalHost {
    pub addr: String,
    child: ChildProcess,
}

/// How to launch one `troupe host` child.
pub(crate) struct HostLaunch {
    pub host_id: String,
    pub gpus: Vec<u32>,
    pub heartbeat: Duration,
    pub max_message_bytes: u64,
    pub shutdown_grace: Duration,
    pub timeout: Duration,
    pub token: Option<String>,
    pub tls: troupe_actors::tls::TlsFiles,
}

impl LocalHost {
    pub async fn launch(bin: &Path, l: HostLaunch) -> Result<LocalHost, String> {
        let HostLaunch {
            host_id,
            gpus,
            heartbeat,
            max_message_bytes,
            shutdown_grace,
            timeout,
            token,
            tls,
        } = l;
        let mut cmd = Command::new(bin);
        cmd.arg("host")
            .args(["--listen", "127.0.0.1:0", "--host-id", &host_id])
            .args(["--heartbeat-ms", &heartbeat.as_millis().to_string()])
            .args([
                "--max-message-mb",
                &(max_message_bytes as f64 / 1048576.0).to_string(),
            ])
            .args([
                "--shutdown-grace-s",
                &shutdown_grace.as_secs_f64().to_string(),
            ])
            .stdout(Stdio::piped());
        // Through the environment, not argv: argv is visible to every user on the machine.
        match &token {
            Some(t) => cmd.env(troupe_actors::auth::TOKEN_ENV, t),
            None => cmd.env_remove(troupe_actors::auth::TOKEN_ENV),
        };
        // The host's TLS identity, by path (the host reads and checks the files itself).
        use troupe_actors::tls::{CERT_ENV, KEY_ENV};
        for (var, path) in [(CERT_ENV, &tls.cert), (KEY_ENV, &tls.key)] {
            match path {
                Some(p) => cmd.env(var, p),
                None => cmd.env_remove(var),
            };
        }
        if !gpus.is_empty() {
            let g: Vec<String> = gpus.iter().map(|g| g.to_string()).collect();
            cmd.args(["--gpus", &g.join(",")]);
        }
        let mut child = ChildProcess::spawn(cmd, None)
            .map_err(|e| format!("cannot start {} host: {e}", bin.display()))?;
        let out = child
            .take_stdout()
            .ok_or_else(|| "host stdout was not captured".to_string())?;
        let mut lines = BufReader::new(out).lines();
        let wait = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(a) = line.strip_prefix(READY_PREFIX) {
                    return Ok(a.trim().to_string());
                }
            }
            Err(format!(
                "{host_id} exited before it was ready (see its stderr above)"
            ))
        };
        let addr = tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| format!("{host_id} did not report ready within {timeout:?}"))??;
        // Keep draining stdout so the host never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(LocalHost { addr, child })
    }

    pub async fn terminate(&mut self, grace: Duration) {
        let _ = self.child.terminate(grace).await;
    }
}
