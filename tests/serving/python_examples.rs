//! The plain-Python examples (`examples/python/`) against a real PD deployment: a slime-style
//! loop with SGLang's names (admin key) and a SkyRL-style loop with vLLM's names (no key:
//! `gateway.control_auth: none` on loopback). Skipped when `python3` with `requests` and
//! `aiohttp` is missing, unless `TROUPE_REQUIRE_PYTHON=1` (CI sets it and installs them).

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::within;
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_scheduler::AllocationPlan;
use troupe_serving::gateway::{ControlAuthMode, GatewayConfig};

use super::fleet_control::safetensors;

fn python_ready() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import requests, aiohttp"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("TROUPE_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "TROUPE_REQUIRE_PYTHON=1 but python3 with requests and aiohttp is missing (pip install requests aiohttp)"
        );
        eprintln!("SKIP: python3 with requests and aiohttp is not available");
    }
    ok
}

async fn run_example(script: &str, args: &[&str]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/python")
        .join(script);
    let out = tokio::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    assert!(text.contains("ok: generation changed"), "{text}");
    eprintln!("{script}: {text}");
}

async fn fork(cluster: &Cluster, control_auth: ControlAuthMode) -> Deployment {
    let plan = AllocationPlan::parse("troupe:(prefill:d1t1|decode:d1t1)").unwrap();
    let opts = ForkOptions {
        admin_key: Some("k".into()),
        ready_timeout: Duration::from_secs(60),
        gateway: GatewayConfig {
            listen: "127.0.0.1:0".into(),
            control_auth,
            ..ForkOptions::default().gateway
        },
        ..ForkOptions::default()
    };
    Deployment::fork(cluster, &plan, &opts).await.unwrap()
}

#[tokio::test]
async fn the_slime_and_skyrl_style_examples_update_every_engine() {
    if !python_ready() {
        return;
    }
    within(240, async {
        let dir = tempfile::tempdir().unwrap();
        let weights = dir.path().join("new.safetensors");
        std::fs::write(&weights, safetensors(21)).unwrap();
        let weights = weights.to_str().unwrap();

        let cluster = Cluster::in_process(1, 2).await.unwrap();
        let svc = fork(&cluster, ControlAuthMode::Key).await;
        run_example(
            "slime_style.py",
            &[
                "--gateway",
                &svc.gateway_url,
                "--admin-key",
                "k",
                "--weights",
                weights,
                "--version",
                "s1",
            ],
        )
        .await;
        svc.teardown().await;

        let svc = fork(&cluster, ControlAuthMode::None).await;
        run_example(
            "skyrl_style.py",
            &[
                "--gateway",
                &svc.gateway_url,
                "--weights",
                weights,
                "--version",
                "k1",
            ],
        )
        .await;
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
