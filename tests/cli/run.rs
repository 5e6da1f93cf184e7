//! The main job as a user runs it: `troupe run` on the shipped config, seeded, CI-sized.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

#[test]
fn seeded_grpo_run_with_fp8_sync_improves_the_reward() {
    let cfg = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/configs/grpo-local.yaml"
    );
    let dir = tempfile::tempdir().unwrap();
    let summary = dir.path().join("run.json");
    let plot = dir.path().join("run.svg");
    let out = Command::new(BIN)
        .args(["run", cfg, "train.steps=30", "--summary"])
        .arg(&summary)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        30,
        "a line per step"
    );
    assert!(
        stdout.contains("(fp8)"),
        "the shipped config syncs FP8 weights: {stdout}"
    );
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
    assert_eq!(s["steps"], 30);
    assert_eq!(s["rewards"].as_array().unwrap().len(), 30);
    assert_eq!(s["sync_seconds"].as_array().unwrap().len(), 30);
    assert_eq!(s["tokens_per_s"].as_array().unwrap().len(), 30);
    assert_eq!(s["staleness"].as_array().unwrap().len(), 30);
    // The curves, one SVG a browser opens: four panels with their titles and lines.
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") || svg.contains("<svg "),
        "{}",
        &svg[..svg.len().min(200)]
    );
    for title in [
        "mean reward",
        "generation tokens/s",
        "weight sync seconds",
        "staleness",
    ] {
        assert!(svg.contains(title), "{title} missing");
    }
    assert!(svg.matches("<polyline").count() >= 4, "a line per panel");
    let (base, fin) = (
        s["baseline_reward"].as_f64().unwrap(),
        s["final_reward"].as_f64().unwrap(),
    );
    assert!(
        fin >= 2.0 * base && fin >= base + 0.2,
        "reward must clearly improve: {base} -> {fin}"
    );
    assert!(
        s["max_staleness_seen"].as_u64().unwrap() >= 1,
        "rollouts really ran ahead of training"
    );
}

#[test]
fn run_without_a_training_component_is_refused_clearly() {
    let cfg = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/configs/grpo-local.yaml"
    );
    let out = Command::new(BIN)
        .args([
            "run",
            cfg,
            "allocation_mode=troupe:(prefill:d1t1|decode:d2t1)",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("+fsdp:d1"));
}

#[test]
fn run_places_its_trainer_on_troupe_host_processes_too() {
    let cfg = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/configs/grpo-local.yaml"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "run",
            cfg,
            "scheduler.type=local",
            "train.steps=3",
            "--summary",
        ])
        .arg(dir.path().join("run.json"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        3,
        "{stdout}"
    );
}
