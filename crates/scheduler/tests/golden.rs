//! `troupe alloc` output against golden files in `tests/golden/`.
//!
//! After an intended change of the output, regenerate with
//! `TROUPE_UPDATE_GOLDEN=1 cargo test -p troupe-scheduler --test golden` and review the diff.

use std::path::PathBuf;

use clap::Parser;
use troupe_scheduler::SchedulerError;
use troupe_scheduler::preview::{AllocArgs, run_alloc};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    alloc: AllocArgs,
}

fn args(argv: &[&str]) -> AllocArgs {
    let argv = std::iter::once("troupe-alloc").chain(argv.iter().copied());
    Cli::try_parse_from(argv)
        .unwrap_or_else(|e| panic!("{e}"))
        .alloc
}

fn check(file: &str, argv: &[&str]) {
    let out = run_alloc(&args(argv)).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(file);
    if std::env::var_os("TROUPE_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, format!("{out}\n")).unwrap();
    }
    let golden = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set TROUPE_UPDATE_GOLDEN=1)", path.display()));
    assert_eq!(
        format!("{out}\n"),
        golden,
        "output of {argv:?} differs from {file}"
    );
    if argv.contains(&"--json") {
        let value: serde_json::Value = serde_json::from_str(&out).expect("exactly one JSON value");
        assert!(value.is_object());
    }
}

#[test]
fn pd_with_trainer_table_and_placement() {
    check(
        "pd_fsdp_2x8.txt",
        &["sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8", "--hosts", "2"],
    );
}

#[test]
fn pd_with_trainer_json_and_placement() {
    check(
        "pd_fsdp_2x8.json",
        &[
            "sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8",
            "--hosts",
            "2",
            "--json",
        ],
    );
}

#[test]
fn moe_hybrid_table_without_hosts() {
    check("moe_hybrid.txt", &["megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"]);
}

#[test]
fn colocation_json_without_hosts() {
    check(
        "colocate.json",
        &["sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4", "--json"],
    );
}

#[test]
fn wide_instance_table_on_small_hosts() {
    check(
        "wide_2x4.txt",
        &[
            "sglang[rollout]:d1t8|fsdp[actor]:d8",
            "--hosts",
            "2",
            "--gpus-per-host",
            "4",
        ],
    );
}

#[test]
fn json_matches_the_issue_shape() {
    let out = run_alloc(&args(&[
        "sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8",
        "--hosts",
        "2",
        "--json",
    ]))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["world_size"], 16);
    assert_eq!(v["components"][0]["backend"], "sglang");
    assert_eq!(v["components"][0]["role"], "inference");
    assert_eq!(v["components"][0]["name"], serde_json::Value::Null);
    assert_eq!(v["components"][0]["colocate_with"], serde_json::Value::Null);
    assert_eq!(v["components"][0]["groups"][0]["worker_type"], "prefill");
    assert_eq!(v["components"][0]["groups"][0]["gpus_per_instance"], 2);
    assert_eq!(v["components"][1]["groups"][0]["worker_type"], "train");
    let first = &v["placement"][0];
    assert_eq!(first["gpus"], serde_json::json!([0, 1]));
    assert_eq!(
        first["ports"],
        serde_json::json!({"http": 10000, "dist": 10001, "bootstrap": 10002})
    );
    assert!(v["placement"][2]["ports"].get("bootstrap").is_none());
    // Without --hosts there is no placement key.
    let out = run_alloc(&args(&["sglang:d4", "--json"])).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("placement").is_none());
}

#[test]
fn defaults_and_errors() {
    let a = args(&["sglang:d4"]);
    assert_eq!((a.hosts, a.gpus_per_host, a.json), (None, 8, false));
    let err = run_alloc(&args(&["sglang.d4+fsdp.d4"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid allocation mode `sglang.d4+fsdp.d4` at column 7: expected `:` after backend \
         `sglang`, found `.`\n  example: sglang:d4+fsdp:d4"
    );
    let err = run_alloc(&args(&["sglang:d4t2+fsdp:d8", "--hosts", "1"])).unwrap_err();
    assert!(err.to_string().contains("need 16 GPUs, have 8"), "{err}");
    for bad in [
        &["sglang:d4", "--hosts", "0"][..],
        &["sglang:d4", "--hosts", "1", "--gpus-per-host", "0"],
        &["sglang:d4", "--hosts", "2000000"],
    ] {
        let err = run_alloc(&args(bad)).unwrap_err();
        assert!(matches!(err, SchedulerError::Args { .. }), "{err:?}");
        assert!(err.to_string().contains("example: troupe alloc"), "{err}");
    }
}
