//! Tests of config loading and validation.
use super::*;
use troupe_serving::gateway::GatewayConfig;
use troupe_serving::policy::{CacheAwareConfig, PolicyKind};

#[test]
fn token_and_tls_come_from_the_config_first() {
    // Files that exist (their content is checked where TLS is set up, not here).
    let f = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let yaml = format!(
        "allocation_mode: x\nscheduler: {{type: local}}\ntoken: cfg\ntls: {{cert: {f}, key: {f}, ca: {f}}}\n"
    );
    let c = ServeConfig::from_yaml(&yaml, "t.yaml", &[]).unwrap();
    // Whatever TROUPE_TOKEN / TROUPE_TLS_* say, the config's values win.
    assert_eq!(c.token().as_deref(), Some("cfg"));
    let t = c.tls();
    assert_eq!(t.ca.as_deref(), Some(Path::new(f)));
    assert_eq!(t.cert.as_deref(), Some(Path::new(f)));
    // A missing file, and TLS with in-process hosts (where it would be unused), are errors.
    let missing = "allocation_mode: x\nscheduler: {type: local}\ntls: {cert: /nonexistent/c.pem}\n";
    let e = ServeConfig::from_yaml(missing, "t.yaml", &[]).unwrap_err();
    assert!(e.to_string().contains("tls.cert"), "{e}");
    let inproc = format!("allocation_mode: x\ntls: {{ca: {f}}}\n");
    let e = ServeConfig::from_yaml(&inproc, "t.yaml", &[]).unwrap_err();
    assert!(e.to_string().contains("inprocess"), "{e}");
    let e = ServeConfig::from_yaml("allocation_mode: x\ntls: {crt: c.pem}\n", "t.yaml", &[])
        .unwrap_err();
    assert!(e.to_string().contains("crt"), "{e}");
}

#[test]
fn unknown_keys_and_bad_overrides_are_named() {
    let e = ServeConfig::from_yaml("allocation_mode: x\nrolout: {}\n", "t.yaml", &[]).unwrap_err();
    assert!(e.to_string().contains("rolout"), "{e}");
    let e =
        ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &["nokey".into()]).unwrap_err();
    assert!(e.to_string().contains("dotted.key=value"), "{e}");
    let e = ServeConfig::from_yaml(
        "allocation_mode: x\n",
        "t.yaml",
        &["sglang.quantization=int4".into()],
    )
    .unwrap_err();
    assert!(e.to_string().contains("fp8"), "{e}");
    let e = ServeConfig::from_yaml(
        "allocation_mode: x\n",
        "t.yaml",
        &["allocation_mode.x=1".into()],
    )
    .unwrap_err();
    assert!(e.to_string().contains("not a mapping"), "{e}");
}

#[test]
fn enum_like_values_are_checked_at_load_naming_the_key() {
    let ok = ServeConfig::from_yaml(
        "allocation_mode: x\ngateway: {policy: round_robin, decode_policy: sticky}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    let g = ok.gateway.to_gateway();
    assert_eq!(g.router.policy, PolicyKind::RoundRobin);
    assert_eq!(g.router.prefill_policy, PolicyKind::RoundRobin);
    assert_eq!(g.router.decode_policy, PolicyKind::Sticky);
    let open = ServeConfig::from_yaml(
        "allocation_mode: x\ngateway: {listen: '127.0.0.1:0', control_auth: none}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    assert_eq!(
        open.gateway.to_gateway().control_auth,
        troupe_serving::gateway::ControlAuthMode::None
    );
    // weights.delta: YAML's bare on/off (which a loader may read as booleans) and the words.
    use troupe_weights::delta::DeltaMode;
    for (yaml, want) in [
        ("on", DeltaMode::On),
        ("off", DeltaMode::Off),
        ("compress", DeltaMode::Compress),
        ("false", DeltaMode::Off),
    ] {
        let c = ServeConfig::from_yaml(
            &format!("allocation_mode: x\nweights: {{delta: {yaml}}}\n"),
            "t.yaml",
            &[],
        )
        .unwrap();
        assert_eq!(c.weights.delta, want, "{yaml}");
    }
    // weights.bucket_mib: a size in MiB, named when out of range.
    let c = ServeConfig::from_yaml(
        "allocation_mode: x\nweights: {bucket_mib: 8}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    assert_eq!(c.weights.bucket_bytes(), 8 << 20);
    // weights.staging: auto by default, off on request, anything else named.
    assert_eq!(
        c.weights.staging,
        troupe_serving::control_plane::Staging::Auto
    );
    let off = ServeConfig::from_yaml(
        "allocation_mode: x\nweights: {staging: off}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    assert_eq!(
        off.weights.staging,
        troupe_serving::control_plane::Staging::Off
    );
    let e = ServeConfig::from_yaml(
        "allocation_mode: x\nweights: {staging: maybe}\n",
        "t.yaml",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("staging"), "{e}");
    // weights.rollout: all by default; rolling by a share or a count; bad parts named.
    use troupe_serving::control_plane::{PartSize, Rollout};
    assert_eq!(c.weights.rollout(), Rollout::All);
    let r = |y: &str| {
        ServeConfig::from_yaml(
            &format!("allocation_mode: x\nweights: {y}\n"),
            "t.yaml",
            &[],
        )
    };
    assert_eq!(
        r("{rollout: rolling}").unwrap().weights.rollout(),
        Rollout::Rolling(PartSize::Fraction(0.25))
    );
    assert_eq!(
        r("{rollout: rolling, rolling_part: 2}")
            .unwrap()
            .weights
            .rollout(),
        Rollout::Rolling(PartSize::Count(2))
    );
    for bad in ["0", "1.5", "-1", "x"] {
        let e = r(&format!("{{rollout: rolling, rolling_part: {bad}}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rolling_part"), "{bad}: {e}");
    }
    assert_eq!(c.weights.rolling_drain_s, 60.0);
    assert_eq!(
        r("{rolling_drain_s: 2.5}").unwrap().weights.rolling_drain_s,
        2.5
    );
    for bad in ["-1", "1e9", ".nan", "x"] {
        let e = r(&format!("{{rolling_drain_s: {bad}}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rolling_drain_s"), "{bad}: {e}");
    }
    let d = ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &[]).unwrap();
    assert_eq!(
        d.weights.bucket_bytes(),
        troupe_weights::bucket::DEFAULT_BUCKET_BYTES
    );
    for bad in ["0", "16385", "-1", "big"] {
        let e = ServeConfig::from_yaml(
            &format!("allocation_mode: x\nweights: {{bucket_mib: {bad}}}\n"),
            "t.yaml",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bucket_mib"), "{bad}: {e}");
    }
    // One set of defaults: the gateway's own.
    let d = ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &[]).unwrap();
    assert_eq!(
        d.gateway.to_gateway().router,
        GatewayConfig::default().router
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = format!("gateway.listen={}", taken.local_addr().unwrap());
    for (o, needle) in [
        ("gateway.policy=fastest", "policy"),
        ("gateway.decode_policy=rr", "decode_policy"),
        ("gateway.listen=not an address", "gateway.listen"),
        ("gateway.control_auth=none", "loopback"),
        ("gateway.control_auth=maybe", "control_auth"),
        ("rollout.stale_policy=keep", "stale_policy"),
        (busy.as_str(), "in use"),
        ("sglang.quantization=fp4", "sglang.quantization"),
        ("weights.delta=maybe", "weights.delta"),
        ("weights.delta=maybe", "auto, on, off or compress"),
        ("weights.zstd=1", "zstd"),
        ("sglang.ready_timeout_s=1e20", "sglang.ready_timeout_s"),
        ("sglang.model_path=/nonexistent/model", "sglang.model_path"),
        ("cluster.n_nodes=1000000000", "cluster.n_nodes"),
        ("cluster.n_gpus_per_node=4000000", "GPUs"),
        (
            "scheduler.startup_timeout_s=1e20",
            "scheduler.startup_timeout_s",
        ),
    ] {
        let e = ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &[o.to_string()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{o}: {e}");
    }
    // On Slurm's or a Ray cluster's nodes this machine's files and ports say nothing.
    for kind in ["slurm", "ray"] {
        let o = [
            format!("scheduler.type={kind}"),
            "sglang.model_path=/nonexistent/model".to_string(),
            busy.clone(),
        ];
        ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &o)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
}

#[test]
fn cache_aware_keys_use_sglangs_names_and_defaults() {
    let c = ServeConfig::from_yaml(
        "allocation_mode: x\ngateway: {policy: cache_aware, cache_threshold: 0.5, max_tree_size: 1000}\n",
        "t.yaml",
        &["gateway.balance_abs_threshold=8".into()],
    )
    .unwrap();
    assert_eq!(
        c.gateway.to_gateway().io_threads,
        0,
        "on the host's runtime by default"
    );
    let r = c.gateway.to_gateway().router;
    assert_eq!(r.policy, PolicyKind::CacheAware);
    assert_eq!(r.decode_policy, PolicyKind::CacheAware);
    let d = CacheAwareConfig::default();
    assert_eq!(
        r.cache_aware,
        CacheAwareConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 8,
            max_tree_size: 1000,
            ..d
        }
    );
    assert_eq!(
        (d.balance_rel_threshold, d.eviction_interval_secs),
        (1.5, 60)
    );
    for (o, needle) in [
        ("gateway.cache_threshold=1.5", "gateway.cache_threshold"),
        ("gateway.cache_threshold=-0.1", "gateway.cache_threshold"),
        ("gateway.cache_threshold=.nan", "gateway.cache_threshold"),
        (
            "gateway.balance_rel_threshold=0.9",
            "gateway.balance_rel_threshold",
        ),
        (
            "gateway.balance_rel_threshold=.nan",
            "gateway.balance_rel_threshold",
        ),
        (
            "gateway.balance_abs_threshold=-1",
            "gateway.balance_abs_threshold",
        ),
        (
            "gateway.eviction_interval_secs=0",
            "gateway.eviction_interval_secs",
        ),
        ("gateway.max_tree_size=0", "gateway.max_tree_size"),
        ("gateway.max_tree_size=-5", "gateway.max_tree_size"),
        ("gateway.io_threads=5000", "gateway.io_threads"),
        ("gateway.io_threads=-1", "gateway.io_threads"),
    ] {
        let e = ServeConfig::from_yaml("allocation_mode: x\n", "t.yaml", &[o.to_string()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{o}: {e}");
    }
}

#[test]
fn sglang_and_vllm_engine_fields_pass_through_checked() {
    let ok = ServeConfig::from_yaml(
        "allocation_mode: x\nsglang:\n  model_path: tiny\n  mem_fraction_static: 0.8\n  enable_memory_saver: true\n  chunked_prefill_size: 4096\nvllm:\n  gpu_memory_utilization: 0.9\n  enforce_eager: false\n",
        "t.yaml",
        &["sglang.random_seed=7".to_string()],
    )
    .unwrap();
    let sg = ok.engine_flags(EngineDialect::Sglang).unwrap();
    assert_eq!(
        sg,
        [
            "--chunked-prefill-size",
            "4096",
            "--enable-memory-saver",
            "--mem-fraction-static",
            "0.8",
            "--random-seed",
            "7"
        ]
    );
    let vl = ok.engine_flags(EngineDialect::Vllm).unwrap();
    assert_eq!(
        vl,
        ["--no-enforce-eager", "--gpu-memory-utilization", "0.9"]
    );
    for (yaml, needle) in [
        ("sglang: {mem_fraction_statc: 0.8}", "mem_fraction_static"),
        ("sglang: {tp_size: 2}", "allocation_mode"),
        ("sglang: {port: 1}", "port allocation"),
        (
            "vllm: {gpu_memory_utilisation: 0.9}",
            "gpu_memory_utilization",
        ),
        ("vllm: {tensor_parallel_size: 2}", "allocation_mode"),
        ("sglang: {enable_memory_saver: maybe}", "switch"),
    ] {
        let e = ServeConfig::from_yaml(&format!("allocation_mode: x\n{yaml}\n"), "t.yaml", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{yaml}: {e}");
    }
}

#[cfg(feature = "reference")]
#[test]
fn the_gateways_tokenizer_is_the_engines_own_by_default() {
    // No key: the reference engine's tokenizer, under the name its engines list.
    for y in [
        "allocation_mode: 'troupe:d1'\nsglang: {model_path: tiny}\n",
        "allocation_mode: 'troupe:d1'\nsglang: {model_path: tiny}\ngateway: {tokenizer: auto}\n",
    ] {
        let c = ServeConfig::from_yaml(y, "t.yaml", &[]).unwrap();
        let agent = c.gateway.to_gateway().agent.expect("an agent layer");
        assert_eq!(
            (agent.model.as_str(), agent.tool_call_parser.as_str()),
            ("troupe-tiny", "reference")
        );
        assert_eq!(
            agent.aliases,
            ["tiny"],
            "the name it had before still works"
        );
        let line = c.gateway.agent_line();
        assert!(
            line.contains("reference engine's built-in tokenizer") && line.contains("troupe-tiny"),
            "{line}"
        );
    }
    // The engines' own --served-model-name is the agent layer's name too.
    let c = ServeConfig::from_yaml(
        "allocation_mode: 'troupe:d1'\nsglang: {model_path: small, extra_args: [--served-model-name, m1]}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    assert_eq!(c.gateway.to_gateway().agent.unwrap().model, "m1");
    // `none`: a pure inference gateway.
    let c = ServeConfig::from_yaml(
        "allocation_mode: 'troupe:d1'\ngateway: {tokenizer: none}\n",
        "t.yaml",
        &[],
    )
    .unwrap();
    assert!(c.gateway.to_gateway().agent.is_none());
    assert!(c.gateway.agent_line().contains("tokenizer: none"));
    // A model the gateway cannot read: off by default, and the line says why; `auto` asked
    // for it, so its absence is an error naming the key.
    let hub = "allocation_mode: 'sglang:d1'\nsglang: {model_path: org/model}\n";
    let c = ServeConfig::from_yaml(hub, "t.yaml", &[]).unwrap();
    assert!(c.gateway.to_gateway().agent.is_none());
    let line = c.gateway.agent_line();
    assert!(
        line.contains("off") && line.contains("org/model") && line.contains("tokenizer.json"),
        "{line}"
    );
    let d = "allocation_mode: 'sglang:d1'\nsglang: {model_path: /nonexistent/m}\ngateway: {tokenizer: auto}\n";
    let e = ServeConfig::from_yaml(d, "t.yaml", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("gateway.tokenizer /nonexistent/m"), "{e}");
    let e = ServeConfig::from_yaml(
        "allocation_mode: x\ngateway: {tokenizer: none, tool_call_parser: hermes}\n",
        "t.yaml",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("need gateway.tokenizer"), "{e}");
}
