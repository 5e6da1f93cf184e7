//! The YAML/serde config form converges on the same `AllocationPlan` as mode strings.

use serde::Deserialize;
use troupe_scheduler::{AllocationConfig, AllocationPlan, SchedulerError, WorkerType};

#[test]
fn allocation_mode_key_equals_parsed_string() {
    let yaml = "allocation_mode: \"sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8\"\n";
    let from_yaml = AllocationPlan::from_yaml(yaml).unwrap();
    let parsed = AllocationPlan::parse("sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8").unwrap();
    assert_eq!(from_yaml, parsed);
}

#[test]
fn explicit_components_equal_the_mode_string() {
    let yaml = r#"
components:
  - backend: sglang
    name: rollout
    groups:
      - {worker_type: prefill, dp: 2, tp: 2}
      - {worker_type: decode, dp: 4}
  - {backend: fsdp, name: actor, dp: 8}
  - {backend: fsdp, name: critic, dp: 8, colocate_with: actor}
"#;
    let from_yaml = AllocationPlan::from_yaml(yaml).unwrap();
    let parsed = AllocationPlan::parse(
        "sglang[rollout]:(prefill:d2t2|decode:d4)+fsdp[actor]:d8|fsdp[critic]:d8",
    )
    .unwrap();
    assert_eq!(from_yaml, parsed);
    assert_eq!(from_yaml.world_size(), 16);
}

#[test]
fn overrides_survive_and_round_trip_through_yaml() {
    let yaml = r#"
components:
  - backend: sglang
    groups:
      - worker_type: prefill
        dp: 1
        tp: 2
        overrides: {disaggregation_transfer_backend: mooncake, mem_fraction_static: 0.8}
      - {worker_type: decode, dp: 2}
"#;
    let plan = AllocationPlan::from_yaml(yaml).unwrap();
    let prefill = &plan.components[0].groups[0];
    assert_eq!(prefill.worker_type, WorkerType::Prefill);
    assert_eq!(
        prefill.overrides.get("disaggregation_transfer_backend"),
        Some(&serde_json::json!("mooncake"))
    );
    let text = serde_yaml_ng::to_string(&plan).unwrap();
    let back = AllocationPlan::from_yaml(&text).unwrap();
    assert_eq!(back, plan);
    let json = serde_json::to_string(&plan).unwrap();
    let back: AllocationPlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, plan);
}

#[derive(Deserialize)]
struct RunConfig {
    allocation: AllocationPlan,
}

#[test]
fn plan_deserializes_from_a_string_or_a_map_inside_a_larger_config() {
    let a: RunConfig = serde_yaml_ng::from_str("allocation: \"sglang:d4+fsdp:d4\"\n").unwrap();
    let b: RunConfig =
        serde_yaml_ng::from_str("allocation:\n  allocation_mode: \"sglang:d4+fsdp:d4\"\n").unwrap();
    let c: RunConfig = serde_yaml_ng::from_str(
        "allocation:\n  components:\n    - {backend: sglang, dp: 4}\n    - {backend: fsdp, dp: 4}\n",
    )
    .unwrap();
    assert_eq!(a.allocation, b.allocation);
    assert_eq!(a.allocation, c.allocation);
}

#[test]
fn invalid_embedded_plan_fails_deserialization_with_the_rule() {
    let err = serde_yaml_ng::from_str::<RunConfig>("allocation: \"fsdp:d4p2\"\n")
        .err()
        .expect("fsdp with p must be rejected");
    assert!(err.to_string().contains("FSDP does not support"), "{err}");
}

fn config_error(yaml: &str) -> String {
    match AllocationPlan::from_yaml(yaml) {
        Ok(plan) => panic!("config should be rejected, got `{plan}`"),
        Err(e @ SchedulerError::Config { .. }) => e.to_string(),
        Err(e @ SchedulerError::Rule { .. }) | Err(e @ SchedulerError::Syntax { .. }) => {
            e.to_string()
        }
        Err(other) => panic!("unexpected error kind {other:?}"),
    }
}

#[test]
fn config_errors_are_clear() {
    let cases: &[(&str, &str)] = &[
        ("{}", "the allocation is empty"),
        (
            "allocation_mode: \"sglang:d4\"\ncomponents: [{backend: fsdp, dp: 4}]",
            "not both",
        ),
        (
            "allocation_mode: \"sglang.d4\"",
            "expected `:` after backend",
        ),
        (
            "components: [{backend: sgl, dp: 4}]",
            "unknown variant `sgl`",
        ),
        (
            "components: [{backend: sglang, dpp: 4}]",
            "unknown field `dpp`",
        ),
        (
            "components: [{backend: sglang, groups: [{worker_type: prefil}]}]",
            "unknown variant `prefil`",
        ),
        (
            "components: [{backend: sglang, dp: 2, groups: [{dp: 2}]}]",
            "both `groups` and inline sizes",
        ),
        (
            "components: [{backend: vllm, groups: [{worker_type: prefill}, {worker_type: decode}]}]",
            "cannot run prefill/decode groups",
        ),
        (
            "components: [{backend: sglang, dp: 0}]",
            "sizes are at least 1",
        ),
        (
            "components: [{backend: sglang, groups: [{dp: 1}, {dp: 2}]}]",
            "exactly one",
        ),
        (
            "components: [{backend: fsdp, groups: [{worker_type: decode}]}]",
            "exactly one `train` group",
        ),
        (
            "components: [{backend: sglang, groups: [{worker_type: train}]}]",
            "cannot have a `train` group",
        ),
        (
            "components: [{backend: sglang, dp: 2, cp: 2}]",
            "takes only d, t, p",
        ),
        (
            "components: [{backend: fsdp, name: a, dp: 4}, {backend: fsdp, name: b, dp: 4, colocate_with: x}]",
            "no component has that name",
        ),
        (
            "components: [{backend: fsdp, name: a, dp: 4}, {backend: fsdp, name: b, dp: 4, colocate_with: a}, {backend: fsdp, name: c, dp: 4, colocate_with: b}]",
            "itself colocated",
        ),
        (
            "components: [{backend: fsdp, name: a, dp: 4}, {backend: fsdp, dp: 4, colocate_with: a}]",
            "must be named",
        ),
        (
            "components: [{backend: fsdp, name: \"my actor\", dp: 4}]",
            "not an identifier",
        ),
        (
            "components: [{backend: megatron, dp: 3, ep: 2}]",
            "does not divide",
        ),
        (
            "components: [{backend: fsdp, dp: 4, etp: 2}]",
            "FSDP does not support",
        ),
    ];
    for (yaml, needle) in cases {
        let text = config_error(yaml);
        assert!(
            text.contains(needle),
            "config `{yaml}` should mention `{needle}`, got:\n{text}"
        );
        assert!(text.contains("example"), "no example for `{yaml}`:\n{text}");
    }
}

#[test]
fn config_struct_can_be_built_in_code() {
    let config = AllocationConfig {
        allocation_mode: Some("sglang:d2+fsdp:d2".into()),
        components: Vec::new(),
    };
    assert_eq!(config.into_plan().unwrap().world_size(), 4);
}
