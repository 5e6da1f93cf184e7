//! `troupe bench rpc` as users run it: every figure printed, and `--vs-ray` saying clearly why
//! it cannot run (timings are never asserted: benchmarks measure, tests check behaviour).

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

#[test]
fn bench_rpc_prints_every_figure() {
    let out = Command::new(BIN)
        .args(["bench", "rpc", "--calls", "200", "--inflight", "8"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for path in ["ractor", "local", "remote"] {
        for fig in [
            "seq.p50_us",
            "seq.p99_us",
            "seq.calls_per_s",
            "pipelined.calls_per_s",
        ] {
            let name = format!("rpc.{path}.{fig}");
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} missing from:\n{text}"));
            let v: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert!(v.is_finite() && v > 0.0, "{line}");
        }
    }
    assert!(
        !text.contains("rpc.ray."),
        "no Ray figures without --vs-ray"
    );
}

#[test]
fn vs_ray_without_a_usable_python_says_why() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "rpc",
            "--calls",
            "100",
            "--vs-ray",
            "/no/such/python",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--vs-ray") && err.contains("/no/such/python"),
        "{err}"
    );

    // A Python without Ray (a stand-in that fails the way `import ray` does).
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("python-without-ray");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'ray'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(BIN)
        .args(["bench", "rpc", "--calls", "100", "--vs-ray"])
        .arg(&fake)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("No module named 'ray'") && err.contains("import ray"),
        "{err}"
    );
}
