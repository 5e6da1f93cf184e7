//! `troupe bench rpc` (and `broadcast`, `scale`, `rollout`) as users run them: every figure
//! printed, and bad flags or `--vs-ray` saying clearly why they cannot run (timings are never asserted: benchmarks measure, tests check behaviour).

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
    for path in ["ractor", "local", "remote", "remote_grpc"] {
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
    // The socket's floor (a raw loopback ping-pong of a call-sized message) and the remote
    // paths' latency over it.
    for name in [
        "rpc.floor.seq.p50_us",
        "rpc.floor.seq.p99_us",
        "rpc.floor.seq.calls_per_s",
        "rpc.remote_vs_floor.seq.ratio",
        "rpc.remote_grpc_vs_floor.seq.ratio",
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"));
        let v: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(v.is_finite() && v > 0.0, "{line}");
    }
    assert!(
        !text.contains("rpc.ray."),
        "no Ray figures without --vs-ray"
    );
}

#[test]
fn bench_broadcast_reads_from_the_ring_unless_told_to_chain() {
    // (flags, receivers on the ring per count) for 1 and 3 receivers of 2 MiB.
    let ring = if cfg!(target_os = "linux") {
        [1, 3]
    } else {
        [0, 0]
    };
    for (extra, on_ring) in [(None, ring), (Some("--chain"), [0, 0])] {
        let mut args = vec!["bench", "broadcast", "--receivers", "1,3", "--mib", "2"];
        args.extend(extra);
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        for (n, want) in [1, 3].into_iter().zip(on_ring) {
            let line = format!("broadcast.receivers_{n}.on_ring {want}");
            assert!(
                text.lines().any(|l| l == line),
                "{args:?}: no {line:?} in\n{text}"
            );
            assert!(
                text.contains(&format!("broadcast.receivers_{n}.seconds ")),
                "{text}"
            );
        }
    }
    let out = Command::new(BIN)
        .args(["bench", "broadcast", "--mib", "2", "--ring-kib", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--ring-kib"), "{err}");
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

/// Runs `troupe ARGS`, killing it after `secs`; (success, stdout, stderr).
fn troupe_within(args: &[&str], secs: u64) -> (bool, String, String) {
    use std::io::Read;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "troupe {} did not finish within {secs} s; stderr:\n{}",
                args.join(" "),
                err.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

const SCALE_FIGURES: [&str; 24] = [
    "scale.hosts",
    "scale.servers",
    "scale.time_wait_at_start",
    "scale.bringup_s",
    "scale.slowest_server_s",
    "scale.server_start_p50_s",
    "scale.bringup_overhead_s",
    "scale.controller_rss_mib",
    "scale.engine_rss_mib",
    "scale.fanout_first_pause_ms",
    "scale.fanout_first_resume_ms",
    "scale.fanout_p50_ms",
    "scale.fanout_p99_ms",
    "scale.fanout_max_ms",
    "scale.fanout_controller_cpu_ms",
    "scale.fanout_engines_cpu_ms",
    "scale.version_change_ms",
    "scale.generate_p50_ms",
    "scale.weight_update_s",
    "scale.weight_update_again_s",
    "scale.host_loss_event_ms",
    "scale.host_loss_detect_ms",
    "scale.teardown_s",
    "scale.controller_peak_rss_mib",
];

#[test]
fn bench_scale_prints_every_figure() {
    let (ok, text, err) = troupe_within(
        &[
            "bench",
            "scale",
            "--hosts",
            "2",
            "--servers",
            "4",
            "--rounds",
            "3",
        ],
        240,
    );
    assert!(ok, "{err}");
    for name in SCALE_FIGURES {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"));
        let v: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(v.is_finite(), "{line}");
    }
    assert!(text.contains("scale.servers 4"), "{text}");
    // The engines' few µs per call are counted (ticks of 10 ms would read 0 here).
    let engines_cpu = text
        .lines()
        .find_map(|l| l.strip_prefix("scale.fanout_engines_cpu_ms "))
        .and_then(|v| v.parse::<f64>().ok());
    assert!(engines_cpu.is_some_and(|v| v > 0.0), "{text}");

    // PD, as one JSON object with the same names.
    let (ok, text, err) = troupe_within(
        &[
            "bench",
            "scale",
            "--hosts",
            "2",
            "--servers",
            "4",
            "--layout",
            "pd",
            "--rounds",
            "1",
            "--json",
        ],
        240,
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    for name in SCALE_FIGURES {
        assert!(v[name].as_f64().is_some_and(f64::is_finite), "{name}: {v}");
    }
}

/// `--engine stub`: the benchmark's stand-ins on `troupe host` processes; every stand-in
/// switches to the new version, the gateway routes `/generate` to them, and the hosts' CPU
/// replaces the engines'.
#[test]
fn bench_scale_with_stub_engines_prints_its_figures() {
    let (ok, text, err) = troupe_within(
        &[
            "bench",
            "scale",
            "--hosts",
            "2",
            "--servers",
            "4",
            "--engine",
            "stub",
            "--rounds",
            "3",
        ],
        240,
    );
    assert!(ok, "{err}");
    let figure = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
    };
    assert_eq!(figure("scale.version_seen_servers"), 4.0, "{text}");
    for name in [
        "scale.bringup_s",
        "scale.controller_rss_mib",
        "scale.host_rss_mib",
        "scale.fanout_p99_ms",
        "scale.fanout_hosts_cpu_ms",
        "scale.version_change_ms",
        "scale.version_seen_all_ms",
        "scale.generate_p50_ms",
        "scale.host_loss_detect_ms",
    ] {
        assert!(figure(name).is_finite(), "{name}: {text}");
    }
    assert!(!text.contains("scale.weight_update_s"), "{text}");
    assert!(!text.contains("scale.engine_rss_mib"), "{text}");
}

/// `troupe bench <bench> ARGS` fails, says `says`, and panics on none of `cases`.
fn refuses(bench: &str, cases: &[(&[&str], &str)]) {
    for &(args, says) in cases {
        let mut all = vec!["bench", bench];
        all.extend_from_slice(args);
        let (ok, _, err) = troupe_within(&all, 30);
        assert!(!ok, "{args:?} must fail");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn bench_scale_refuses_flags_that_make_no_fleet() {
    refuses(
        "scale",
        &[
            (
                &["--hosts", "2", "--servers", "3"],
                "not a multiple of --hosts",
            ),
            (&["--hosts", "1", "--servers", "3", "--layout", "pd"], "odd"),
            (&["--servers", "0"], "--servers"),
            (&["--hosts", "0"], "--hosts"),
        ],
    );
}

#[test]
fn bench_gateway_refuses_bad_flags() {
    refuses(
        "gateway",
        &[
            (&["--io-threads", "0"], "--io-threads"),
            (&["--io-threads", "x"], "--io-threads"),
            (&["--concurrency", "0"], "--concurrency"),
            (&["--backend-latency-ms=-1"], "--backend-latency-ms"),
            (&["--backend-latency-ms", "NaN"], "--backend-latency-ms"),
        ],
    );
}

/// `troupe bench rollout` on a small GRPO-shaped load: every figure is printed, the baseline
/// takes nothing from a cache, and cache-aware routing serves most of each group's prompt from
/// one (a behaviour, not a timing: groups of 4 share one prompt).
#[test]
fn bench_rollout_prints_every_figure_and_the_cache_serves_groups() {
    let (ok, out, err) = troupe_within(
        &[
            "bench",
            "rollout",
            "--prompt-tokens",
            "96",
            "--group",
            "4",
            "--groups",
            "3",
            "--max-new-tokens",
            "4",
        ],
        240,
    );
    assert!(ok, "{err}");
    let fig = |name: &str| -> f64 {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from:\n{out}"))
    };
    for c in ["baseline", "cache_aware"] {
        for k in [
            "tokens_per_s",
            "cache_hit_rate",
            "prefill_computed_tokens",
            "prefill_cached_tokens",
            "kv_received_tokens",
            "kv_local_tokens",
        ] {
            fig(&format!("rollout.{c}.{k}"));
        }
    }
    fig("rollout.pd.tokens_per_s");
    fig("rollout.speedup");
    assert_eq!(fig("rollout.baseline.cache_hit_rate"), 0.0);
    assert_eq!(
        fig("rollout.baseline.prefill_computed_tokens"),
        3.0 * 4.0 * 96.0
    );
    // Each group computes its prompt once and three samples copy all but its last token.
    assert!(fig("rollout.cache_aware.cache_hit_rate") >= 0.7, "{out}");

    let (ok, _, err) = troupe_within(&["bench", "rollout", "--layout", "ring"], 30);
    assert!(!ok);
    assert!(err.contains("--layout \"ring\""), "{err}");
    let (ok, _, err) = troupe_within(&["bench", "rollout", "--policy", "fastest"], 30);
    assert!(!ok);
    assert!(err.contains("--policy"), "{err}");
}
