//! Finding the local Ray cluster, skipping loudly without one, and asking it questions through
//! its own Python API.

use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The cluster the tests use: its GCS address and an interpreter with `ray`.
#[derive(Debug, Clone)]
pub struct RayCluster {
    /// `ip:port` of the head's GCS.
    pub address: String,
    /// Python with `ray` installed.
    pub python: String,
}

/// Where `scripts/ray-local.sh` keeps its state (`$TROUPE_RAY_DIR`, default `/tmp/troupe-ray`).
fn state_dir() -> std::path::PathBuf {
    std::env::var_os("TROUPE_RAY_DIR")
        .filter(|v| !v.is_empty())
        .map(Into::into)
        .unwrap_or_else(|| "/tmp/troupe-ray".into())
}

/// Runs `script` (Python) with the cluster's interpreter and `args`; its stdout, or why not.
/// Bounded: 60 s.
pub fn run_python(py: &str, script: &str, args: &[&str]) -> Result<String, String> {
    let mut child = std::process::Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {py}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{py} did not answer within 60 s"));
            }
        }
    }
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!(
            "{py} failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

const ALIVE_NODES: &str = r#"
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 2))
"#;

/// The cluster, or why it cannot be used (computed once per test binary).
fn probe() -> Result<RayCluster, String> {
    static FOUND: OnceLock<Result<RayCluster, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let dir = state_dir();
            let address = match std::env::var("TROUPE_RAY_ADDRESS") {
                Ok(a) if !a.is_empty() => a,
                _ => std::fs::read_to_string(dir.join("address"))
                    .map(|s| s.trim().to_string())
                    .map_err(|e| format!("no {}/address ({e})", dir.display()))?,
            };
            let python = match std::env::var("TROUPE_RAY_PYTHON") {
                Ok(p) if !p.is_empty() => p,
                _ => std::fs::read_to_string(dir.join("python"))
                    .map(|s| s.trim().to_string())
                    .map_err(|e| format!("no {}/python ({e})", dir.display()))?,
            };
            let n = run_python(&python, ALIVE_NODES, &[&address])?;
            if n.parse::<u32>().unwrap_or(0) < 3 {
                return Err(format!(
                    "need 3 live Ray nodes with 2 GPUs each at {address}, found {n}"
                ));
            }
            Ok(RayCluster { address, python })
        })
        .clone()
}

/// The cluster when usable; otherwise skips (prints why) or, with TROUPE_REQUIRE_RAY=1, fails.
pub fn ray_ready(test: &str) -> Option<RayCluster> {
    match probe() {
        Ok(c) => Some(c),
        Err(why) => {
            if std::env::var("TROUPE_REQUIRE_RAY").as_deref() == Ok("1") {
                panic!("{test}: TROUPE_REQUIRE_RAY=1 but Ray is not usable: {why}");
            }
            eprintln!(
                "SKIP {test}: {why} (start one with `bash scripts/ray-local.sh install && bash scripts/ray-local.sh start --nodes 3`)"
            );
            None
        }
    }
}

const PG_STATE: &str = r#"
import sys, ray
from ray.util import placement_group_table
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
t = placement_group_table().get(sys.argv[2])
print(t["state"] if t else "UNKNOWN")
"#;

/// Ray's state of placement group `id` (`CREATED`, `REMOVED`, ...; `UNKNOWN` when Ray has none).
pub fn placement_group_state(c: &RayCluster, id: &str) -> String {
    run_python(&c.python, PG_STATE, &[&c.address, id]).unwrap_or_else(|e| panic!("{e}"))
}
