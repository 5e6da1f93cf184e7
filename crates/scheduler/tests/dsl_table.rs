//! The table of accepted and rejected allocation modes.

use troupe_scheduler::{AllocationPlan, Backend, Parallel, SchedulerError, WorkerType};

/// (mode, canonical display, total GPUs, [(worker_type, dp, tp, pp, cp, ep, etp) per group of
/// every component, flattened])
type Groups = &'static [(WorkerType, u32, u32, u32, u32, u32, u32)];

const ACCEPTED: &[(&str, &str, u64, Groups)] = {
    use WorkerType::{Decode as D, Prefill as P, Regular as R, Train as T};
    &[
        ("fsdp:d8", "fsdp:d8", 8, &[(T, 8, 1, 1, 1, 1, 1)]),
        ("sglang:d8", "sglang:d8", 8, &[(R, 8, 1, 1, 1, 1, 1)]),
        (
            "sglang:d4t2+fsdp:d8",
            "sglang:d4t2+fsdp:d8",
            16,
            &[(R, 4, 2, 1, 1, 1, 1), (T, 8, 1, 1, 1, 1, 1)],
        ),
        (
            "sglang:d8t2+megatron:d4p2t2",
            "sglang:d8t2+megatron:d4t2p2",
            32,
            &[(R, 8, 2, 1, 1, 1, 1), (T, 4, 2, 2, 1, 1, 1)],
        ),
        // AReaL's MoE example: dp4 tp2 pp2 cp2 ep2 etp4, world 32.
        (
            "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
            "megatron:(attn:d4t2p2c2|ffn:t4p2e2)",
            32,
            &[(T, 4, 2, 2, 2, 2, 4)],
        ),
        // Parentheses optional, ffn d derived.
        (
            "megatron:attn:d4p2t2c2|ffn:p2t4e2",
            "megatron:(attn:d4t2p2c2|ffn:t4p2e2)",
            32,
            &[(T, 4, 2, 2, 2, 2, 4)],
        ),
        (
            "archon:(attn:d1p12t4|ffn:d1p12e4)",
            "archon:d1t4p12e4",
            48,
            &[(T, 1, 4, 12, 1, 4, 1)],
        ),
        (
            "megatron:d2p2t4",
            "megatron:d2t4p2",
            16,
            &[(T, 2, 4, 2, 1, 1, 1)],
        ),
        (
            "megatron:d4e2",
            "megatron:d4e2",
            4,
            &[(T, 4, 1, 1, 1, 2, 1)],
        ),
        ("fsdp:d2t2c2", "fsdp:d2t2c2", 8, &[(T, 2, 2, 1, 2, 1, 1)]),
        // AReaL 1.0.4 (areal/api/alloc_mode.py, `colocate_expr`): the first component of a
        // colocation group is the anchor and may go unnamed; the others must be named.
        (
            "sglang:d4|fsdp[a]:d4",
            "sglang:d4|fsdp[a]:d4",
            4,
            &[(R, 4, 1, 1, 1, 1, 1), (T, 4, 1, 1, 1, 1, 1)],
        ),
        (
            "vllm:d2t4|megatron[actor]:d2t2p2",
            "vllm:d2t4|megatron[actor]:d2t2p2",
            8,
            &[(R, 2, 4, 1, 1, 1, 1), (T, 2, 2, 2, 1, 1, 1)],
        ),
        // `disaggregate_chain` alone requires every name; one colocation group of three does
        // not.
        (
            "sglang:d4|fsdp[a]:d4|fsdp[b]:d4",
            "sglang:d4|fsdp[a]:d4|fsdp[b]:d4",
            4,
            &[
                (R, 4, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
            ],
        ),
        // `train_backend_hybrid` takes every TRAIN_BACKEND, fsdp included (FSDP's own rule
        // then allows no e or p above 1).
        (
            "fsdp:(attn:d4|ffn:d4)",
            "fsdp:d4",
            4,
            &[(T, 4, 1, 1, 1, 1, 1)],
        ),
        ("fsdp:d4p1e1", "fsdp:d4", 4, &[(T, 4, 1, 1, 1, 1, 1)]),
        ("vllm:d2t4p2", "vllm:d2t4p2", 16, &[(R, 2, 4, 2, 1, 1, 1)]),
        // A repeated dimension: the last wins.
        ("sglang:d2d4", "sglang:d4", 4, &[(R, 4, 1, 1, 1, 1, 1)]),
        (
            " sglang : d4 t2 + fsdp : d8 ",
            "sglang:d4t2+fsdp:d8",
            16,
            &[(R, 4, 2, 1, 1, 1, 1), (T, 8, 1, 1, 1, 1, 1)],
        ),
        // PD groups.
        (
            "sglang:(prefill:d2t2|decode:d4t1)",
            "sglang:(prefill:d2t2|decode:d4)",
            8,
            &[(P, 2, 2, 1, 1, 1, 1), (D, 4, 1, 1, 1, 1, 1)],
        ),
        (
            "sglang:(P:d1t2|D:d1t1)",
            "sglang:(prefill:d1t2|decode:d1)",
            3,
            &[(P, 1, 2, 1, 1, 1, 1), (D, 1, 1, 1, 1, 1, 1)],
        ),
        (
            "sglang(P:d1t2|D:d1t1)",
            "sglang:(prefill:d1t2|decode:d1)",
            3,
            &[(P, 1, 2, 1, 1, 1, 1), (D, 1, 1, 1, 1, 1, 1)],
        ),
        (
            "troupe:(prefill:d1|decode:d1)",
            "troupe:(prefill:d1|decode:d1)",
            2,
            &[(P, 1, 1, 1, 1, 1, 1), (D, 1, 1, 1, 1, 1, 1)],
        ),
        (
            "sglang:(decode:d2|prefill:d1)",
            "sglang:(decode:d2|prefill:d1)",
            3,
            &[(D, 2, 1, 1, 1, 1, 1), (P, 1, 1, 1, 1, 1, 1)],
        ),
        (
            "sglang:(prefill:d1t4|prefill:d2t2|decode:d4)",
            "sglang:(prefill:d1t4|prefill:d2t2|decode:d4)",
            12,
            &[
                (P, 1, 4, 1, 1, 1, 1),
                (P, 2, 2, 1, 1, 1, 1),
                (D, 4, 1, 1, 1, 1, 1),
            ],
        ),
        (
            "sglang[rollout]:(prefill:d2t2|decode:d4)+fsdp[actor]:d8",
            "sglang[rollout]:(prefill:d2t2|decode:d4)+fsdp[actor]:d8",
            16,
            &[
                (P, 2, 2, 1, 1, 1, 1),
                (D, 4, 1, 1, 1, 1, 1),
                (T, 8, 1, 1, 1, 1, 1),
            ],
        ),
        (
            "sglang[rollout]:prefill:d1|decode:d2|fsdp[actor]:d3",
            "sglang[rollout]:(prefill:d1|decode:d2)|fsdp[actor]:d3",
            3,
            &[
                (P, 1, 1, 1, 1, 1, 1),
                (D, 2, 1, 1, 1, 1, 1),
                (T, 3, 1, 1, 1, 1, 1),
            ],
        ),
        // Names, 3+ components, colocation.
        (
            "sglang[r]:d2+fsdp[a]:d4+fsdp[c]:d4",
            "sglang[r]:d2+fsdp[a]:d4+fsdp[c]:d4",
            10,
            &[
                (R, 2, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
            ],
        ),
        (
            "sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4",
            "sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4",
            6,
            &[
                (R, 2, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
                (T, 4, 1, 1, 1, 1, 1),
            ],
        ),
        (
            "sglang[r]:d4t2|megatron[a]:d4p2",
            "sglang[r]:d4t2|megatron[a]:d4p2",
            8,
            &[(R, 4, 2, 1, 1, 1, 1), (T, 4, 1, 2, 1, 1, 1)],
        ),
    ]
};

#[test]
fn accepted_modes_parse_to_the_expected_plan() {
    for (mode, canonical, world, groups) in ACCEPTED {
        let plan = AllocationPlan::parse(mode)
            .unwrap_or_else(|e| panic!("`{mode}` should parse, got: {e}"));
        assert_eq!(plan.to_string(), *canonical, "canonical form of `{mode}`");
        assert_eq!(plan.world_size(), *world, "world size of `{mode}`");
        let got: Vec<(WorkerType, u32, u32, u32, u32, u32, u32)> = plan
            .components
            .iter()
            .flat_map(|c| &c.groups)
            .map(|g| {
                let p = g.parallel;
                (g.worker_type, p.dp, p.tp, p.pp, p.cp, p.ep, p.etp)
            })
            .collect();
        assert_eq!(got, groups.to_vec(), "groups of `{mode}`");
        let again = AllocationPlan::parse(canonical).expect("canonical form parses");
        assert_eq!(again, plan, "canonical form of `{mode}` round-trips");
    }
}

#[test]
fn moe_example_has_areals_numbers() {
    let plan = AllocationPlan::parse("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)").unwrap();
    let c = &plan.components[0];
    assert_eq!(c.backend, Backend::Megatron);
    let p = c.groups[0].parallel;
    assert_eq!(
        p,
        Parallel {
            dp: 4,
            tp: 2,
            pp: 2,
            cp: 2,
            ep: 2,
            etp: 4
        }
    );
    assert_eq!(p.world_size(), 32);
    // Expert data parallel = world / (p·etp·e) = 32 / 16 = 2, as written in the ffn section.
    assert_eq!(p.world_size() / p.expert_model_parallel_size(), 2);
}

#[test]
fn colocation_and_names_are_recorded() {
    let plan = AllocationPlan::parse("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4").unwrap();
    assert_eq!(plan.components[2].colocate_with.as_deref(), Some("a"));
    assert_eq!(plan.components[1].colocate_with, None);
    assert_eq!(plan.component("c").map(|c| c.world_size()), Some(4));
    assert_eq!(plan.component_index("r"), Some(0));
    let pd = AllocationPlan::parse("sglang:(prefill:d2t2|decode:d4t1)").unwrap();
    let g = &pd.components[0].groups;
    assert_eq!((g[0].instances(), g[0].gpus_per_instance()), (2, 2));
    assert_eq!((g[1].instances(), g[1].gpus_per_instance()), (4, 1));
    assert!(pd.components[0].is_pd());
}

/// (mode, substring of the message, whether the example must itself be a valid mode)
const REJECTED: &[(&str, &str, bool)] = &[
    ("", "empty", true),
    ("   ", "empty", true),
    (
        "sglang.d4+fsdp.d4",
        "expected `:` after backend `sglang`, found `.`",
        true,
    ),
    ("d4t2", "`d4t2` has no backend", true),
    ("d2p2t4", "has no backend", true),
    ("[actor]:d4", "needs a backend before its name", true),
    ("attn:d4|ffn:e2", "needs an explicit backend", true),
    ("(attn:d4|ffn:e2)", "needs a backend before it", true),
    ("foo:d4", "unknown backend `foo`", true),
    ("SGLang:d4", "did you mean `sglang`", true),
    ("sglng:d4", "did you mean `sglang`", true),
    ("sglang", "expected `:` after backend `sglang`", true),
    ("sglang:", "expected parallel dimensions", true),
    ("sglang:+fsdp:d4", "expected parallel dimensions", true),
    ("sglang:d4+", "expected a component after `+`", true),
    ("sglang[r]:d4|", "expected a component after `|`", true),
    ("sglang:d4)", "found `)`", true),
    ("sglang[]:d4", "expected a name", true),
    ("sglang[r:d4", "expected `]`", true),
    ("sglang(r):d4", "names go in brackets", true),
    ("sglang:d0", "positive integers", true),
    ("sglang:d04", "leading zeros", true),
    ("sglang:d", "needs a size", true),
    ("sglang:dt2", "needs a size", true),
    ("sglang:d4x2", "unknown parallel dimension `x`", true),
    ("sglang:D4", "lowercase", true),
    ("sglang:d99999999999", "too large", true),
    ("sglang:d2000000", "more than the supported", true),
    ("sglang:d4c2", "takes only d, t, p", true),
    ("sglang:d4e2", "takes only d, t, p", true),
    // AReaL's rules.
    (
        "sglang[a]:d4+fsdp[a]:d4",
        "duplicate component name `a`",
        true,
    ),
    ("sglang:d2+fsdp:d4+fsdp:d4", "all must be named", true),
    ("sglang[r]:d2+fsdp[a]:d4+fsdp:d4", "all must be named", true),
    ("fsdp:d4p2", "FSDP does not support pipeline parallel", true),
    ("fsdp:d4e2", "FSDP does not support expert parallel", true),
    (
        "sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d2",
        "equal world sizes",
        true,
    ),
    (
        "sglang:d2+fsdp:d4|fsdp:d4",
        "every component after the first",
        true,
    ),
    ("sglang:d4|fsdp:d4", "every component after the first", true),
    // `disaggregate_chain`: 3+ components across `+` must all be named, the anchor too.
    ("sglang[r]:d2+fsdp:d4|fsdp[c]:d4", "all must be named", true),
    ("sglang:d4|fsdp[a]:d4+fsdp[b]:d4", "all must be named", true),
    // The grammar's `hybrid_moe_syntax`: `attn` first, then `ffn`.
    (
        "megatron:(ffn:e2|attn:d2)",
        "the `attn` section comes first",
        true,
    ),
    (
        "megatron:(attn:d4p2|ffn:p4e2)",
        "pipeline parallel size of attn and ffn",
        true,
    ),
    (
        "megatron:(attn:d4|ffn:d3e2)",
        "world sizes of attn (4) and ffn (6)",
        true,
    ),
    ("megatron:(attn:d3|ffn:e2)", "cannot derive ffn d", true),
    (
        "megatron:(attn:d4e2|ffn:e2)",
        "not allowed in the `attn` section",
        true,
    ),
    (
        "megatron:(attn:d4c2|ffn:c2e2)",
        "not allowed in the `ffn` section",
        true,
    ),
    (
        "megatron:(attn:d4|attn:d4)",
        "exactly one `attn` and one `ffn`",
        true,
    ),
    ("megatron:(attn:d4)", "both an `attn` and an `ffn`", true),
    ("megatron:d3e2", "does not divide its world size 3", true),
    (
        "fsdp:(attn:d4|ffn:e2)",
        "FSDP does not support expert parallel",
        true,
    ),
    ("sglang:(attn:d4|ffn:e2)", "is for training backends", true),
    // PD rules.
    (
        "vllm:(prefill:d1|decode:d1)",
        "cannot run prefill/decode groups",
        true,
    ),
    ("sglang:(prefill:d1p2|decode:d1)", "need p = 1", true),
    ("sglang:(prefill:d1|decode:d1t2p2)", "need p = 1", true),
    ("sglang:(prefill:d2)", "no decode group", true),
    ("sglang:(decode:d2)", "no prefill group", true),
    (
        "fsdp:(prefill:d1|decode:d1)",
        "for inference backends",
        true,
    ),
    ("sglang:(prefill:d1|attn:d1)", "cannot be mixed", true),
    (
        "sglang:(prefil:d1|decode:d1)",
        "unknown section `prefil`",
        true,
    ),
    ("sglang:(p:d1|decode:d1)", "unknown section `p`", true),
    ("sglang:(prefill:d1|decode:d1", "expected `|` or `)`", true),
    (
        "sglang:(prefill d1|decode:d1)",
        "expected `:` after section `prefill`",
        true,
    ),
    (
        "sglang:(prefill:d1c2|decode:d1)",
        "not allowed in the `prefill` section",
        true,
    ),
    ("sglang:()", "expected a section", true),
];

#[test]
fn rejected_modes_explain_themselves() {
    for (mode, needle, example_is_valid) in REJECTED {
        let err = match AllocationPlan::parse(mode) {
            Ok(plan) => panic!("`{mode}` should be rejected, parsed as `{plan}`"),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(
            text.contains(needle),
            "error for `{mode}` should mention `{needle}`, got:\n{text}"
        );
        assert!(
            text.contains("example: "),
            "`{mode}`: no example in\n{text}"
        );
        let example = match &err {
            SchedulerError::Syntax { example, .. } | SchedulerError::Rule { example, .. } => {
                example.clone()
            }
            other => panic!("`{mode}`: unexpected error kind {other:?}"),
        };
        if *example_is_valid && let Err(e) = AllocationPlan::parse(&example) {
            panic!("example `{example}` given for `{mode}` is itself invalid: {e}");
        }
    }
}

#[test]
fn the_dot_example_is_the_corrected_mode() {
    let err = AllocationPlan::parse("sglang.d4+fsdp.d4").unwrap_err();
    match err {
        SchedulerError::Syntax {
            column, example, ..
        } => {
            assert_eq!(column, 7);
            assert_eq!(example, "sglang:d4+fsdp:d4");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
}

#[test]
fn from_str_matches_parse() {
    let plan: AllocationPlan = "sglang:d4+fsdp:d4".parse().unwrap();
    assert_eq!(plan, AllocationPlan::parse("sglang:d4+fsdp:d4").unwrap());
}

#[test]
fn huge_inputs_get_short_errors() {
    // Many unnamed components: one short message, at most a few names listed.
    let many = vec!["sglang:d1"; 3000].join("+");
    let e = AllocationPlan::parse(&many).unwrap_err().to_string();
    assert!(e.len() < 1000, "{} bytes: {e}", e.len());
    let sixty = vec!["sglang:d1"; 60].join("+");
    let e = AllocationPlan::parse(&sixty).unwrap_err().to_string();
    assert!(e.contains("and 55 more"), "{e}");
    assert!(e.len() < 1000, "{} bytes", e.len());
    // Past the component cap: refused with the cap named.
    let e = AllocationPlan::parse(&vec!["sglang[a]:d1"; 65].join("+"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 64"), "{e}");
}

#[test]
fn the_naming_example_gives_every_unnamed_component_a_distinct_name() {
    let err = AllocationPlan::parse("sglang:d1+sglang:d1+fsdp[rollout2]:d1+fsdp:d1").unwrap_err();
    let SchedulerError::Rule { example, .. } = err else {
        panic!("expected a rule error, got {err:?}");
    };
    let plan = AllocationPlan::parse(&example).unwrap();
    let names: Vec<_> = plan
        .components
        .iter()
        .map(|c| c.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["rollout", "rollout3", "rollout2", "actor"]);
}
