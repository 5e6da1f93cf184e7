//! `troupe plan`: what `troupe serve` would launch, without starting anything; config errors
//! surface here first, each naming its key.

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

fn plan(args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .arg("plan")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_plan_lists_every_server_its_command_and_the_weight_group() {
    let out = plan(&["examples/configs/pd-local.yaml", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let servers = v["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 4, "{v}");
    for s in servers {
        let cmd: Vec<&str> = s["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        assert_eq!(cmd[1], "engine", "{cmd:?}");
        let port = s["ports"]["http"].as_u64().unwrap().to_string();
        assert!(
            cmd.windows(2).any(|w| w == ["--port", port.as_str()]),
            "{cmd:?}"
        );
        let decode = s["worker_type"] == "decode";
        // Only a prefill listens for the KV handoff.
        assert_eq!(s["ports"]["bootstrap"].is_null(), decode, "{s}");
        assert_eq!(
            cmd.contains(&"--disaggregation-bootstrap-port"),
            !decode,
            "{cmd:?}"
        );
        assert_eq!(
            s["env"]["TROUPE_ENGINE_ADMIN_KEY"], "<secret>",
            "secrets never print"
        );
    }
    assert_eq!(v["world_size"], 5);
    let offsets: Vec<u64> = v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["rank_offset"].as_u64().unwrap())
        .collect();
    assert_eq!(offsets, [1, 2, 3, 4]);
    // The human form says where the hosts come from.
    let text = plan(&["examples/configs/pd-local.yaml"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("as configured"), "{text}");
}

#[test]
fn engine_fields_show_up_in_the_planned_argv() {
    let out = plan(&[
        "examples/configs/pd-local.yaml",
        "sglang.chunked_prefill_size=512",
        "sglang.enable_memory_saver=true",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cmd = v["servers"][0]["command"].to_string();
    assert!(cmd.contains("\"--chunked-prefill-size\",\"512\""), "{cmd}");
    assert!(cmd.contains("--enable-memory-saver"), "{cmd}");
}

#[test]
fn config_errors_name_their_key_before_anything_starts() {
    for (o, needle) in [
        ("sglang.tp_size=2", "allocation_mode"),
        ("sglang.mem_fraction_statik=0.8", "mem_fraction_static"),
        ("allocation_mode=troupe:d0", "allocation_mode"),
        // Sizes are bounded by what they allocate, at load.
        (
            "train.group_size=4294967296",
            "train.group_size must be 2 to 1024",
        ),
        (
            "train.batch_size=4294967296",
            "train.batch_size must be 1 to 65536",
        ),
        ("train.steps=18446744073709551615", "train.steps"),
        ("train.max_new_tokens=131073", "train.max_new_tokens"),
        (
            "rollout.max_concurrent_rollouts=0",
            "rollout.max_concurrent_rollouts",
        ),
        (
            "rollout.max_head_offpolicyness=99999999",
            "rollout.max_head_offpolicyness",
        ),
    ] {
        let out = plan(&["examples/configs/pd-local.yaml", o]);
        assert!(!out.status.success(), "{o}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{o}: {err}");
    }
}

#[test]
fn a_step_that_would_hold_too_many_tokens_is_refused() {
    let out = plan(&[
        "examples/configs/pd-local.yaml",
        "train.batch_size=65536",
        "train.group_size=1024",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tokens per step"), "{err}");
}

#[test]
fn an_error_quoting_a_huge_number_clips_it() {
    let n = "9".repeat(300);
    let out = plan(&[
        "examples/configs/pd-local.yaml",
        &format!("train.group_size={n}"),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("train.group_size") && err.contains("digits)"),
        "{err}"
    );
    assert!(err.len() < 400, "{err}");
}

#[test]
fn a_slurm_plan_shows_the_sbatch_script() {
    let out = plan(&["examples/configs/pd-slurm.yaml", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let script = v["sbatch"].as_str().unwrap();
    assert!(script.starts_with("#!"), "{script}");
    assert!(
        v["hosts"][0]["address"].as_str().unwrap().contains("node"),
        "{v}"
    );
}

#[test]
fn the_areal_style_example_config_plans_with_its_sglang_keys() {
    let out = plan(&["examples/configs/areal-style.yaml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--mem-fraction-static 0.8",
        "--context-length 4096",
        "--enable-memory-saver",
        "--attention-backend fa3",
    ] {
        assert!(text.contains(flag), "{flag} missing:\n{text}");
    }
}

#[test]
fn secrets_are_refused_as_flags_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    // A key given as a verbatim flag is refused like the field, by name, without its value.
    for flag in ["--admin-api-key", "--api-key", "--ssl-keyfile-password"] {
        let cfg = write(
            "flags.yaml",
            &format!(
                "allocation_mode: \"troupe:d1t1\"\nsglang:\n  extra_args: [\"{flag}\", \"s3cr3t-X\"]\n"
            ),
        );
        let out = plan(&[&cfg]);
        assert!(!out.status.success(), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && !err.contains("s3cr3t-X"), "{err}");
    }
    let cfg = write(
        "eq.yaml",
        "allocation_mode: \"troupe:d1t1\"\nsglang:\n  extra_args: [\"--admin-api-key=s3cr3t-X\"]\n",
    );
    let out = plan(&[&cfg]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("s3cr3t-X"), "{err}");

    // vLLM's Hugging Face token is a string, travels as HF_TOKEN, and the plan shows neither
    // it nor a flag carrying it.
    let cfg = write(
        "vllm.yaml",
        "allocation_mode: \"vllm:d1t1\"\nvllm:\n  hf_token: \"hf_s3cr3t\"\n",
    );
    for args in [vec![cfg.as_str(), "--json"], vec![cfg.as_str()]] {
        let out = plan(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.contains("hf_s3cr3t") && !text.contains("--hf-token"),
            "{text}"
        );
        assert!(text.contains("HF_TOKEN"), "{text}");
    }
    let out = plan(&[&cfg, "vllm.hf_token=12345"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("12345"), "{err}");
}

/// The printed command reads back, through a shell, as exactly the argv launched: a value with
/// a newline, a space or a quote is one quoted word, not several (issue 49).
#[test]
fn the_printed_command_is_quoted_as_a_shell_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("quoted.yaml");
    let base = std::fs::read_to_string("examples/configs/pd-local.yaml").unwrap();
    let text = base.replacen(
        "  model_path: tiny",
        "  model_path: tiny\n  tokenizer_path: \"tok dir/it's\\n--trust-remote-code\"",
        1,
    );
    assert_ne!(text, base, "the example config names its model");
    std::fs::write(&cfg, text).unwrap();
    let cfg = cfg.display().to_string();
    let out = plan(&[&cfg, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let argv: Vec<String> = v["servers"][0]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().replace("$RUN_DIR", "/run/x"))
        .collect();
    assert!(
        argv.iter()
            .any(|a| a == "tok dir/it's\n--trust-remote-code"),
        "{argv:?}"
    );
    let human = plan(&[&cfg]);
    let human = String::from_utf8_lossy(&human.stdout);
    let start = human.find("    command: ").unwrap() + "    command: ".len();
    let line = &human[start..];
    let line = &line[..line.find("\n    ").unwrap_or(line.len())];
    let sh = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("printf '%s\\0' {line}"))
        .env("RUN_DIR", "/run/x")
        .output()
        .unwrap();
    assert!(sh.status.success(), "{line}");
    let words: Vec<String> = String::from_utf8_lossy(&sh.stdout)
        .split_terminator('\0')
        .map(str::to_string)
        .collect();
    // The same words as the JSON argv (ports are drawn again for each plan).
    let port = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit());
    assert_eq!(words.len(), argv.len(), "{line}");
    for (w, a) in words.iter().zip(&argv) {
        assert!(w == a || (port(w) && port(a)), "{w:?} != {a:?} in {line}");
    }
}
