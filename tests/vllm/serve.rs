//! `troupe serve` with `allocation_mode: vllm:d2t1` on real vLLM, on CPU cores: what `troupe
//! plan` shows is what starts (the vLLM venv's python, development mode, scale-out, one core
//! per server, the AMX start-up file), the fleet answers through the gateway, weights load
//! from disk on both servers, and SIGINT leaves no vLLM process behind.

use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::within;
use crate::server;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// Live processes whose command line mentions `needle` (the test's own model directory).
fn processes_naming(needle: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .filter(|pid| crate::common::procs::alive(*pid))
        .collect()
}

#[tokio::test]
async fn troupe_serve_launches_real_vllm_on_cores_and_tears_it_down() {
    let Some(py) = server::python() else { return };
    let _slot = server::SLOT.lock().await;
    within(900, async {
        let dir = tempfile::tempdir().unwrap();
        let (m1, m2) = (dir.path().join("m1"), dir.path().join("m2"));
        server::make_model(&py, &m1, 1);
        server::make_model(&py, &m2, 2);
        let cfg = dir.path().join("vllm.yaml");
        let yaml = format!(
            "allocation_mode: \"vllm:d2t1\"\n\
             cluster: {{n_nodes: 1, n_gpus_per_node: 2}}\n\
             admin_key: vllm-serve-key\n\
             sglang: {{model_path: {m1:?}, ready_timeout_s: 400}}\n\
             vllm:\n  python: {py:?}\n  device: cpu\n  enforce_eager: true\n  \
             kv_cache_memory_bytes: 268435456\n  max_model_len: 1024\n",
            m1 = m1.display().to_string(),
            py = py.display().to_string(),
        );
        std::fs::write(&cfg, yaml).unwrap();

        // The plan says what will start, before anything does.
        let plan = tokio::process::Command::new(BIN)
            .arg("plan")
            .arg(&cfg)
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&plan.stdout);
        assert!(
            plan.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&plan.stderr)
        );
        for want in [
            "VLLM_SERVER_DEV_MODE=1",
            "VLLM_CPU_OMP_THREADS_BIND=0",
            "VLLM_CPU_OMP_THREADS_BIND=1",
            "--enable-scale-out",
            "--kv-cache-memory-bytes",
            "sitecustomize.py",
        ] {
            assert!(text.contains(want), "plan lacks {want}:\n{text}");
        }
        assert!(text.contains(&py.display().to_string()), "{text}");

        let mut serve = tokio::process::Command::new(BIN)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("a line on stdout");
        let url = line
            .strip_prefix("gateway: ")
            .expect("gateway line")
            .to_string();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let model = m1.display().to_string();
        assert!(processes_naming(&model).len() >= 2, "two vLLM servers run");

        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let greedy = || {
            let http = http.clone();
            let (url, model) = (url.clone(), model.clone());
            async move {
                let v: Value = http
                    .post(format!("{url}/v1/completions"))
                    .json(&json!({"model": model, "prompt": "Say a:", "max_tokens": 6,
                                  "temperature": 0, "return_token_ids": true}))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                v["choices"][0]["token_ids"].clone()
            }
        };
        let before = greedy().await;
        assert!(before.is_array(), "{before}");
        let post = |path: &'static str, body: Value| {
            let http = http.clone();
            let url = url.clone();
            async move {
                let r = http
                    .post(format!("{url}{path}"))
                    .bearer_auth("vllm-serve-key")
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let s = r.status().as_u16();
                (s, r.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
        let (s, v) = post("/pause_generation", json!({"mode": "in_place"})).await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = post(
            "/update_weights_from_disk",
            json!({"model_path": m2.display().to_string(), "weight_version": "2"}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = post("/continue_generation", json!({})).await;
        assert_eq!(s, 200, "{v}");
        let after = greedy().await;
        assert_ne!(after, before, "seed 2 answers differently");
        assert_eq!(greedy().await, after, "on both servers");

        // Ctrl-C: everything it started goes.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(serve.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let status = serve.wait().await.unwrap();
        assert!(status.success(), "{status}");
        crate::common::until("no vLLM process left", || async {
            processes_naming(&model).is_empty()
        })
        .await;
    })
    .await;
}
