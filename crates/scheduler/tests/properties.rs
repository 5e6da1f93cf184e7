//! Property tests: round trips, no panics, and placement never double-books GPUs or ports.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use proptest::sample::select;
use troupe_scheduler::{
    AllocationPlan, Backend, Component, Group, HostResources, Parallel, PlacementOptions,
    PortAllocator, SchedulerError, WorkerType, place,
};

fn component(backend: Backend, groups: Vec<Group>) -> Component {
    Component {
        backend,
        name: None,
        colocate_with: None,
        groups,
    }
}

fn regular() -> impl Strategy<Value = Component> {
    (
        select(vec![Backend::Sglang, Backend::Vllm, Backend::Troupe]),
        1..4u32,
        1..5u32,
        1..3u32,
    )
        .prop_map(|(b, dp, tp, pp)| {
            let p = Parallel {
                dp,
                tp,
                pp,
                ..Parallel::default()
            };
            component(b, vec![Group::new(WorkerType::Regular, p)])
        })
}

fn pd() -> impl Strategy<Value = Component> {
    let group = |wt: WorkerType| {
        (1..4u32, 1..5u32).prop_map(move |(dp, tp)| {
            Group::new(
                wt,
                Parallel {
                    dp,
                    tp,
                    ..Parallel::default()
                },
            )
        })
    };
    (
        select(vec![Backend::Sglang, Backend::Troupe]),
        group(WorkerType::Prefill),
        group(WorkerType::Decode),
        proptest::collection::vec(
            select(vec![WorkerType::Prefill, WorkerType::Decode]).prop_flat_map(group),
            0..2,
        ),
        any::<bool>(),
    )
        .prop_map(|(b, p, d, extra, decode_first)| {
            let mut groups = if decode_first { vec![d, p] } else { vec![p, d] };
            groups.extend(extra);
            component(b, groups)
        })
}

fn training() -> impl Strategy<Value = Component> {
    let fsdp = (1..5u32, 1..3u32, 1..3u32).prop_map(|(dp, tp, cp)| {
        let p = Parallel {
            dp,
            tp,
            cp,
            ..Parallel::default()
        };
        component(Backend::Fsdp, vec![Group::new(WorkerType::Train, p)])
    });
    let moe = (
        select(vec![Backend::Megatron, Backend::Archon]),
        (1..3u32, 1..3u32, 1..3u32),
        (1..3u32, 1..3u32, 1..3u32),
    )
        .prop_map(|(b, (k, tp, cp), (pp, etp, ep))| {
            // dp a multiple of etp·ep keeps p·etp·e dividing the world size.
            let p = Parallel {
                dp: k * etp * ep,
                tp,
                pp,
                cp,
                ep,
                etp,
            };
            component(b, vec![Group::new(WorkerType::Train, p)])
        });
    prop_oneof![fsdp, moe]
}

fn any_component() -> impl Strategy<Value = Component> {
    prop_oneof![regular(), pd(), training()]
}

/// A member colocated on an anchor of world size `world`.
fn colocated_member(world: u32, inference: bool) -> Component {
    let p = Parallel {
        dp: world,
        ..Parallel::default()
    };
    if inference {
        component(Backend::Sglang, vec![Group::new(WorkerType::Regular, p)])
    } else {
        component(Backend::Fsdp, vec![Group::new(WorkerType::Train, p)])
    }
}

/// Valid plans: 1–3 pools, each an anchor with 0–2 colocated members.
fn valid_plan() -> impl Strategy<Value = AllocationPlan> {
    proptest::collection::vec(
        (
            any_component(),
            proptest::collection::vec(any::<bool>(), 0..3),
        ),
        1..4,
    )
    .prop_flat_map(|pools| (Just(pools), any::<bool>()))
    .prop_map(|(pools, name_when_optional)| {
        let mut components = Vec::new();
        for (anchor, members) in pools {
            let anchor_index = components.len();
            let world = u32::try_from(anchor.world_size()).unwrap_or(1);
            components.push(anchor);
            for inference in members {
                let mut m = colocated_member(world, inference);
                m.colocate_with = Some(format!("c{anchor_index}"));
                components.push(m);
            }
        }
        let must_name =
            components.len() >= 3 || components.iter().any(|c| c.colocate_with.is_some());
        if must_name || name_when_optional {
            for (i, c) in components.iter_mut().enumerate() {
                c.name = Some(format!("c{i}"));
            }
        }
        AllocationPlan { components }
    })
}

/// Strings built from grammar tokens, to reach deep parser paths.
fn token_soup() -> impl Strategy<Value = String> {
    let tokens = vec![
        "sglang",
        "vllm",
        "troupe",
        "fsdp",
        "megatron",
        "archon",
        ":",
        "(",
        ")",
        "|",
        "+",
        "[",
        "]",
        ".",
        " ",
        "prefill",
        "decode",
        "P",
        "D",
        "attn",
        "ffn",
        "d2",
        "t4",
        "p2",
        "c2",
        "e2",
        "d0",
        "d1",
        "x9",
        "r",
        "a",
        "d4294967296",
        "é",
        "",
    ];
    proptest::collection::vec(select(tokens), 0..14).prop_map(|t| t.concat())
}

fn check_parse_total(s: &str) {
    match AllocationPlan::parse(s) {
        Ok(plan) => {
            let again = AllocationPlan::parse(&plan.to_string());
            assert_eq!(
                again.as_ref(),
                Ok(&plan),
                "display of `{s}` must parse back"
            );
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

proptest! {
    #[test]
    fn display_then_parse_round_trips(plan in valid_plan()) {
        prop_assert_eq!(plan.validate(), Ok(()));
        let text = plan.to_string();
        let parsed = AllocationPlan::parse(&text);
        prop_assert_eq!(parsed.as_ref(), Ok(&plan), "mode `{}`", text);
        // And through the YAML config form.
        let yaml = serde_yaml_ng::to_string(&plan).unwrap();
        prop_assert_eq!(AllocationPlan::from_yaml(&yaml), Ok(plan));
    }

    #[test]
    fn random_strings_never_panic(s in any::<String>()) {
        check_parse_total(&s);
    }

    #[test]
    fn token_soup_never_panics(s in token_soup()) {
        check_parse_total(&s);
    }

    #[test]
    fn placement_never_double_books(
        plan in valid_plan(),
        uniform in any::<bool>(),
        gpus_per_host in select(vec![1u32, 2, 4, 8]),
        extra_hosts in 0..3usize,
        sizes in proptest::collection::vec(1..9u32, 1..6),
        decode_bootstrap_port in any::<bool>(),
    ) {
        let hosts = if uniform {
            let need = usize::try_from(plan.world_size()).unwrap_or(1);
            let count = need.div_ceil(gpus_per_host as usize) + extra_hosts;
            HostResources::uniform(count.max(1), gpus_per_host)
        } else {
            sizes
                .iter()
                .enumerate()
                .map(|(i, n)| HostResources::new(i, format!("10.0.0.{i}"), (0..*n).rev().collect()))
                .collect()
        };
        let mut ports = PortAllocator::preview();
        let opts = PlacementOptions { decode_bootstrap_port };
        let placement = match place(&plan, &hosts, &mut ports, &opts) {
            Ok(p) => p,
            Err(SchedulerError::NotEnoughGpus { needed, available, .. }) => {
                prop_assert!(needed > available);
                return Ok(());
            }
            Err(SchedulerError::NoRoom { .. }) => return Ok(()),
            Err(other) => return Err(TestCaseError::fail(format!("unexpected error {other}"))),
        };
        let host = |index: usize| hosts.iter().find(|h| h.index == index).unwrap();
        // GPUs: owners never share; colocated members only use their target's GPUs.
        let mut owner_uses: BTreeMap<(usize, u32), usize> = BTreeMap::new();
        let mut used_by: BTreeMap<usize, BTreeSet<(usize, u32)>> = BTreeMap::new();
        for e in &placement.instances {
            let h = host(e.host);
            let pos = h.gpu_ids.iter().position(|g| Some(g) == e.gpus.first());
            prop_assert!(pos.is_some(), "GPU {:?} not on host {}", e.gpus, e.host);
            let pos = pos.unwrap();
            prop_assert_eq!(&h.gpu_ids[pos..pos + e.gpus.len()], e.gpus.as_slice(), "contiguous");
            for g in &e.gpus {
                used_by.entry(e.component).or_default().insert((e.host, *g));
                if plan.components[e.component].colocate_with.is_none() {
                    *owner_uses.entry((e.host, *g)).or_default() += 1;
                }
            }
        }
        for ((h, g), uses) in &owner_uses {
            prop_assert_eq!(*uses, 1, "GPU {} of host {} booked {} times", g, h, uses);
        }
        for (c, comp) in plan.components.iter().enumerate() {
            if let Some(target) = comp.colocate_with.as_deref() {
                let t = plan.component_index(target).unwrap();
                prop_assert_eq!(used_by.get(&c), used_by.get(&t), "colocated GPUs of {}", c);
            }
            for (g, group) in comp.groups.iter().enumerate() {
                let entries: Vec<_> = placement
                    .instances
                    .iter()
                    .filter(|e| e.component == c && e.group == g)
                    .collect();
                let gpus: usize = entries.iter().map(|e| e.gpus.len()).sum();
                prop_assert_eq!(gpus as u64, group.world_size());
                let instances: BTreeSet<usize> = entries.iter().map(|e| e.instance).collect();
                prop_assert_eq!(instances.len() as u64, group.instances());
            }
        }
        // Ports: distinct per host, in range; each prefill head has its own bootstrap port.
        let mut per_host: BTreeMap<usize, BTreeSet<u16>> = BTreeMap::new();
        for e in &placement.instances {
            for p in e.ports.all() {
                prop_assert!((10000..=32767).contains(&p));
                prop_assert!(per_host.entry(e.host).or_default().insert(p),
                    "port {} booked twice on host {}", p, e.host);
            }
            let is_head = e.node_rank == 0 && e.worker_type != WorkerType::Train;
            let wants_bootstrap = e.worker_type == WorkerType::Prefill
                || (decode_bootstrap_port && e.worker_type == WorkerType::Decode);
            if is_head {
                prop_assert_eq!(e.ports.bootstrap.is_some(), wants_bootstrap);
                prop_assert!(e.ports.http.is_some() && e.ports.dist.is_some());
            }
        }
        // Deterministic.
        let again = place(&plan, &hosts, &mut PortAllocator::preview(), &opts).unwrap();
        prop_assert_eq!(again, placement);
    }
}
