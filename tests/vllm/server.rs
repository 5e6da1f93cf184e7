//! Real vLLM servers for tests: found, started, waited for and killed (with their engine-core
//! children) by the test that owns them.
//!
//! vLLM comes from the venv `scripts/vllm-cpu.sh` makes: `$TROUPE_VLLM_PYTHON`, else
//! `target/vllm-venv/bin/python`. Without it the tests say so on stderr and pass, unless
//! `TROUPE_REQUIRE_VLLM=1` (set by `.ci/run` once vLLM installed), which makes them fail.
//! The model is `scripts/make-tiny-model.py`'s, made in the test's own temporary directory.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// At most one real-vLLM test at a time in this binary (each starts up to two ~3 GB servers).
pub static SLOT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The vLLM venv's python, or `None` (after saying why) when the tests should skip.
pub fn python() -> Option<PathBuf> {
    let required = std::env::var("TROUPE_REQUIRE_VLLM").as_deref() == Ok("1");
    let py = match std::env::var_os("TROUPE_VLLM_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/vllm-venv/bin/python"),
    };
    let ok = std::process::Command::new(&py)
        .args(["-c", "import vllm"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(py);
    }
    let why = format!(
        "real vLLM is not installed at {} (run `bash scripts/vllm-cpu.sh target/vllm-venv`, or set TROUPE_VLLM_PYTHON)",
        py.display()
    );
    assert!(!required, "TROUPE_REQUIRE_VLLM=1 but {why}");
    eprintln!("SKIPPED (loudly): {why}");
    None
}

/// Writes the tiny model with weight `seed` into `dir` (`scripts/make-tiny-model.py`).
pub fn make_model(python: &Path, dir: &Path, seed: u64) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/make-tiny-model.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(dir)
        .args(["--seed", &seed.to_string()])
        .output()
        .expect("make-tiny-model.py runs");
    assert!(
        out.status.success(),
        "make-tiny-model.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port nothing listens on now (the OS's pick; released for the server to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The environment Troupe gives a vLLM server on a CPU-only host: the development routes its
/// control plane calls, one core of its own, no network.
pub fn cpu_env(core: usize) -> Vec<(String, String)> {
    [
        ("VLLM_SERVER_DEV_MODE", "1".to_string()),
        ("VLLM_CPU_OMP_THREADS_BIND", core.to_string()),
        ("HF_HUB_OFFLINE", "1".to_string()),
        ("VLLM_NO_USAGE_STATS", "1".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The flags every test server gets: eager (no compile warm-up), a small KV cache (the CPU
/// backend otherwise reserves most of the machine's memory), the token route.
pub const CPU_FLAGS: &[&str] = &[
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "268435456",
    "--max-model-len",
    "1024",
    "--enable-scale-out",
];

/// One real vLLM server; killed with its process group when dropped.
pub struct VllmServer {
    child: tokio::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
}

impl VllmServer {
    /// Starts `python -m vllm.entrypoints.openai.api_server` for `model` on a free port, bound
    /// to `core`, logging into `log_dir`; returns at once (see [`VllmServer::ready`]).
    pub fn spawn(python: &Path, model: &Path, core: usize, log_dir: &Path) -> VllmServer {
        let port = free_port();
        let log = log_dir.join(format!("vllm-{port}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let err = file.try_clone().expect("log file");
        let child = tokio::process::Command::new(python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(CPU_FLAGS)
            .envs(cpu_env(core))
            .stdout(file)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("vLLM starts");
        VllmServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// Waits (at most 6 minutes on a loaded 2-core machine) for `GET /health` to answer 200.
    pub async fn ready(&mut self) {
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(360);
        loop {
            if let Ok(r) = http.get(format!("{}/health", self.url)).send().await
                && r.status().is_success()
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "vLLM at {} exited ({status}) before it was ready:\n{}",
                    self.url,
                    self.log_tail()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "vLLM at {} not ready after 6 minutes:\n{}",
                self.url,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            // The API server's engine-core and worker processes are in its group.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// `troupe gateway --listen 127.0.0.1:0 ARGS` as a child (killed when dropped), and the URL its
/// ready line gives.
pub async fn gateway(args: &[&std::ffi::OsStr]) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut gw = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["gateway", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("troupe gateway starts");
    let stdout = gw.stdout.take().expect("piped stdout");
    let line = tokio::io::BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .expect("the gateway's stdout")
        .expect("a ready line");
    let base = line
        .strip_prefix("gateway listening on ")
        .unwrap_or_else(|| panic!("a ready line, got {line:?}"))
        .to_string();
    (gw, base)
}

/// The sum of a vLLM server's Prometheus samples named `name` (0 when it does not answer).
pub async fn metric(server: &str, name: &str) -> f64 {
    let Ok(r) = reqwest::Client::new()
        .get(format!("{server}/metrics"))
        .send()
        .await
    else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
