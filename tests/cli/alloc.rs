//! `troupe alloc` as users and scripts call it: stdout, stderr and exit status.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

#[test]
fn json_plan_and_placement_for_a_pd_mode() {
    let out = Command::new(BIN)
        .args([
            "alloc",
            "sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8",
            "--hosts",
            "2",
            "--gpus-per-host",
            "8",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("exactly one JSON object");
    assert_eq!(v["world_size"], 16);
    let groups = &v["components"][0]["groups"];
    assert_eq!(groups[0]["worker_type"], "prefill");
    assert_eq!(groups[0]["tp"], 2);
    assert_eq!(groups[1]["worker_type"], "decode");
    assert_eq!(v["components"][1]["role"], "training");
    let placement = v["placement"].as_array().unwrap();
    let prefills: Vec<_> = placement
        .iter()
        .filter(|p| p["worker_type"] == "prefill")
        .collect();
    assert_eq!(prefills.len(), 2);
    assert!(prefills.iter().all(|p| p["ports"]["bootstrap"].is_u64()));
    assert!(
        placement
            .iter()
            .filter(|p| p["worker_type"] == "decode")
            .all(|p| p["ports"].get("bootstrap").is_none())
    );
}

#[test]
fn invalid_mode_exits_2_with_a_corrected_example_on_stderr() {
    let out = Command::new(BIN)
        .args(["alloc", "sglang.d4+fsdp.d4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sglang:d4+fsdp:d4"), "{err}");
}

#[test]
fn table_output_names_groups() {
    let out = Command::new(BIN)
        .args(["alloc", "troupe:(P:d1t1|D:d2t1)"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("prefill") && s.contains("decode"), "{s}");
}
