//! Placement on hosts and GPUs, and the port cursor relay.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Arc;

use troupe_scheduler::{
    AllocationPlan, HostResources, InstancePorts, LocalBindProbe, PlacedInstance, Placement,
    PlacementOptions, PortAllocator, PortNeeds, PortProbe, PortRange, SchedulerError, WorkerType,
    place,
};

fn plan(mode: &str) -> AllocationPlan {
    AllocationPlan::parse(mode).unwrap_or_else(|e| panic!("{e}"))
}

fn place_on(mode: &str, hosts: usize, gpus: u32) -> Result<Placement, SchedulerError> {
    let mut ports = PortAllocator::preview();
    place(
        &plan(mode),
        &HostResources::uniform(hosts, gpus),
        &mut ports,
        &PlacementOptions::default(),
    )
}

fn ports(http: Option<u16>, dist: Option<u16>, bootstrap: Option<u16>) -> InstancePorts {
    InstancePorts {
        http,
        dist,
        bootstrap,
    }
}

fn summary(p: &Placement) -> Vec<(usize, usize, usize, WorkerType, usize, Vec<u32>)> {
    p.instances
        .iter()
        .map(|e| {
            (
                e.component,
                e.group,
                e.instance,
                e.worker_type,
                e.host,
                e.gpus.clone(),
            )
        })
        .collect()
}

#[test]
fn pd_groups_and_trainer_get_separate_bundles_and_relayed_ports() {
    let p = place_on("sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8", 2, 8).unwrap();
    use WorkerType::{Decode, Prefill, Train};
    let mut expected = vec![
        (0, 0, 0, Prefill, 0, vec![0, 1]),
        (0, 0, 1, Prefill, 0, vec![2, 3]),
        (0, 1, 0, Decode, 0, vec![4]),
        (0, 1, 1, Decode, 0, vec![5]),
        (0, 1, 2, Decode, 0, vec![6]),
        (0, 1, 3, Decode, 0, vec![7]),
    ];
    expected.extend((0..8).map(|r| (1, 0, r, Train, 1, vec![r as u32])));
    assert_eq!(summary(&p), expected);
    // Prefill takes http, dist, bootstrap; decode http and dist; the next group continues.
    let got: Vec<InstancePorts> = p.instances[..6].iter().map(|e| e.ports).collect();
    assert_eq!(
        got,
        vec![
            ports(Some(10000), Some(10001), Some(10002)),
            ports(Some(10003), Some(10004), Some(10005)),
            ports(Some(10006), Some(10007), None),
            ports(Some(10008), Some(10009), None),
            ports(Some(10010), Some(10011), None),
            ports(Some(10012), Some(10013), None),
        ]
    );
    assert_eq!(
        p.instances[0].dist_init_addr.as_deref(),
        Some("host0:10001")
    );
    // Training: rank 0 owns the rendezvous port on its host; every rank points at it.
    let ranks = &p.instances[6..];
    assert_eq!(ranks[0].ports, ports(None, Some(10000), None));
    assert!(
        ranks[1..]
            .iter()
            .all(|r| r.ports == InstancePorts::default())
    );
    assert!(
        ranks
            .iter()
            .all(|r| r.dist_init_addr.as_deref() == Some("host1:10000"))
    );
    assert!(ranks.iter().all(|r| (r.node_rank, r.nnodes) == (0, 1)));
}

#[test]
fn placement_is_deterministic() {
    let a = place_on("sglang:(prefill:d3t2|decode:d2t2)+megatron:d2p2t2", 3, 8).unwrap();
    let b = place_on("sglang:(prefill:d3t2|decode:d2t2)+megatron:d2p2t2", 3, 8).unwrap();
    assert_eq!(a, b);
}

#[test]
fn not_enough_gpus_says_how_many_are_needed_and_exist() {
    let err = place_on("sglang:d4t2+fsdp:d8", 1, 8).unwrap_err();
    assert_eq!(
        err,
        SchedulerError::NotEnoughGpus {
            needed: 16,
            available: 8,
            hosts: 1
        }
    );
    assert!(err.to_string().contains("need 16 GPUs, have 8"), "{err}");
}

#[test]
fn fragmentation_reports_what_is_free() {
    // 6 GPUs for 6 needed, but after fsdp takes 2 of host 0 no host has 2 left for instance 1.
    let err = place_on("fsdp:d2+sglang:d2t2", 2, 3).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, SchedulerError::NoRoom { needed: 2, .. }),
        "{err:?}"
    );
    assert!(text.contains("need 2 GPUs on one host"), "{text}");
    assert!(text.contains("host 0: 1, host 1: 1"), "{text}");
}

#[test]
fn instances_wider_than_a_host_take_whole_hosts() {
    let p = place_on("sglang:d1t16+fsdp:d8", 3, 8).unwrap();
    let server: Vec<&PlacedInstance> = p.instance(0, 0, 0).collect();
    assert_eq!(server.len(), 2);
    assert_eq!(
        (server[0].host, server[0].node_rank, server[0].nnodes),
        (0, 0, 2)
    );
    assert_eq!(
        (server[1].host, server[1].node_rank, server[1].nnodes),
        (1, 1, 2)
    );
    assert_eq!(server[0].gpus, (0..8).collect::<Vec<u32>>());
    assert_eq!(server[1].gpus, (0..8).collect::<Vec<u32>>());
    assert_eq!(server[0].ports, ports(Some(10000), Some(10001), None));
    assert_eq!(server[1].ports, InstancePorts::default());
    assert_eq!(server[1].dist_init_addr.as_deref(), Some("host0:10001"));
    assert!(
        p.instances
            .iter()
            .filter(|e| e.component == 1)
            .all(|e| e.host == 2)
    );
}

#[test]
fn wide_instances_need_a_multiple_of_the_host_size_and_free_hosts() {
    let err = place_on("sglang:d1t12", 2, 8).unwrap_err();
    assert!(err.to_string().contains("not a multiple of 8"), "{err}");
    // 40 GPUs exist and 40 are needed, but the prefills leave only one whole host free.
    let err = place_on("sglang:(prefill:d4t6|decode:d1t16)", 5, 8).unwrap_err();
    assert!(
        err.to_string()
            .contains("need 16 GPUs on 2 whole free hosts"),
        "{err}"
    );
}

#[test]
fn colocation_reuses_the_targets_gpus() {
    let p = place_on("sglang[r]:d2+fsdp[a]:d4|sglang[c]:d2t2", 1, 8).unwrap();
    let gpus_of = |c: usize| -> Vec<u32> {
        p.instances
            .iter()
            .filter(|e| e.component == c)
            .flat_map(|e| e.gpus.clone())
            .collect()
    };
    assert_eq!(gpus_of(0), vec![0, 1]);
    assert_eq!(gpus_of(1), vec![2, 3, 4, 5]);
    assert_eq!(gpus_of(2), vec![2, 3, 4, 5]);
    let member: Vec<&PlacedInstance> = p.instances.iter().filter(|e| e.component == 2).collect();
    assert_eq!(member[0].gpus, vec![2, 3]);
    assert_eq!(member[1].gpus, vec![4, 5]);
    // Colocated servers still get ports of their own.
    let all: Vec<u16> = p.instances.iter().flat_map(|e| e.ports.all()).collect();
    let distinct: BTreeSet<u16> = all.iter().copied().collect();
    assert_eq!(all.len(), distinct.len());
}

#[test]
fn colocated_instances_may_not_straddle_hosts_unevenly() {
    // Target ranks fill host 0 (3 GPUs) then host 1: instance 1 would be 1 GPU on each host.
    let err = place_on("fsdp[a]:d6|sglang[r]:d3t2", 2, 3).unwrap_err();
    assert!(
        err.to_string().contains("1 on host 0 + 1 on host 1"),
        "{err}"
    );
}

#[test]
fn heterogeneous_hosts_and_sparse_gpu_ids() {
    let hosts = vec![
        HostResources::new(7, "10.0.0.7", vec![4, 5]),
        HostResources::new(3, "10.0.0.3", vec![1, 3, 5, 7]),
    ];
    let mut alloc = PortAllocator::preview();
    let p = place(
        &plan("sglang:d2t2+fsdp:d2"),
        &hosts,
        &mut alloc,
        &PlacementOptions::default(),
    )
    .unwrap();
    assert_eq!(
        summary(&p),
        vec![
            (0, 0, 0, WorkerType::Regular, 7, vec![4, 5]),
            (0, 0, 1, WorkerType::Regular, 3, vec![1, 3]),
            (1, 0, 0, WorkerType::Train, 3, vec![5]),
            (1, 0, 1, WorkerType::Train, 3, vec![7]),
        ]
    );
    assert_eq!(
        p.instances[1].dist_init_addr.as_deref(),
        Some("10.0.0.3:10001")
    );
}

#[test]
fn bad_host_lists_are_rejected() {
    let mut alloc = PortAllocator::preview();
    let opts = PlacementOptions::default();
    let p = plan("sglang:d1");
    let cases: Vec<(Vec<HostResources>, &str)> = vec![
        (vec![], "no hosts"),
        (
            vec![
                HostResources::new(0, "a", vec![0]),
                HostResources::new(0, "b", vec![0]),
            ],
            "index 0 appears twice",
        ),
        (vec![HostResources::new(0, "a", vec![1, 1])], "GPU 1 twice"),
        (vec![HostResources::new(0, " ", vec![0])], "empty address"),
    ];
    for (hosts, needle) in cases {
        let err = place(&p, &hosts, &mut alloc, &opts).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
}

/// A probe that reports a fixed set of ports as taken.
#[derive(Debug)]
struct Taken(BTreeSet<u16>);

impl PortProbe for Taken {
    fn is_free(&self, _host: &HostResources, port: u16) -> bool {
        !self.0.contains(&port)
    }
}

#[test]
fn probed_ports_that_are_taken_are_skipped() {
    let probe = Arc::new(Taken([10001, 10004].into_iter().collect()));
    let mut alloc = PortAllocator::new(PortRange::default(), probe);
    let p = place(
        &plan("sglang:(prefill:d1|decode:d1)"),
        &HostResources::uniform(1, 2),
        &mut alloc,
        &PlacementOptions::default(),
    )
    .unwrap();
    assert_eq!(
        p.instances[0].ports,
        ports(Some(10000), Some(10002), Some(10003))
    );
    assert_eq!(p.instances[1].ports, ports(Some(10005), Some(10006), None));
    assert_eq!(alloc.cursor(&HostResources::uniform(1, 2)[0]), 10007);
}

#[test]
fn decode_bootstrap_ports_are_optional() {
    let mut alloc = PortAllocator::preview();
    let opts = PlacementOptions {
        decode_bootstrap_port: true,
    };
    let p = place(
        &plan("sglang:(prefill:d1|decode:d1)"),
        &HostResources::uniform(1, 2),
        &mut alloc,
        &opts,
    )
    .unwrap();
    assert_eq!(
        p.instances[1].ports,
        ports(Some(10003), Some(10004), Some(10005))
    );
}

#[test]
fn exhausted_ports_fail_and_change_nothing() {
    let mut alloc = PortAllocator::new(
        PortRange::new(10000, 10002).unwrap(),
        Arc::new(Taken(BTreeSet::new())),
    );
    let err = place(
        &plan("sglang:d2"),
        &HostResources::uniform(1, 2),
        &mut alloc,
        &PlacementOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, SchedulerError::PortsExhausted { host: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("10000-10002"), "{err}");
    assert_eq!(
        alloc.cursor(&HostResources::uniform(1, 2)[0]),
        10000,
        "a failed placement must not move the cursor"
    );
}

#[test]
fn port_ranges_are_checked() {
    assert!(PortRange::new(0, 10).is_err());
    assert!(PortRange::new(20, 10).is_err());
    assert_eq!(
        PortRange::new(10, 10).unwrap(),
        PortRange { start: 10, end: 10 }
    );
    assert_eq!(
        PortRange::default(),
        PortRange {
            start: 10000,
            end: 32767
        }
    );
}

#[test]
fn the_cursor_reaches_the_last_port_of_the_range() {
    let range = PortRange::new(65534, 65535).unwrap();
    let mut alloc = PortAllocator::new(range, Arc::new(Taken(BTreeSet::new())));
    let host = HostResources::new(0, "h", vec![0]);
    let needs = PortNeeds {
        http: true,
        dist: true,
        bootstrap: false,
    };
    assert_eq!(
        alloc.take_ports(&host, needs).unwrap(),
        ports(Some(65534), Some(65535), None)
    );
    assert!(alloc.take(&host).is_err());
}

#[test]
fn a_randomized_allocator_starts_anywhere_and_wraps_over_every_port_once() {
    let range = PortRange::new(20000, 20049).unwrap();
    let host = HostResources::new(0, "h", vec![0]);
    let mut starts = BTreeSet::new();
    for _ in 0..8 {
        let mut alloc = PortAllocator::randomized(range, Arc::new(Taken(BTreeSet::new())));
        let mut seen = BTreeSet::new();
        while let Ok(p) = alloc.take(&host) {
            assert!((20000..=20049).contains(&p), "{p} out of range");
            assert!(seen.insert(p), "port {p} handed out twice");
            if seen.len() == 1 {
                starts.insert(p);
            }
        }
        assert_eq!(seen.len(), 50, "every port of the range, once");
    }
    // Eight draws over 50 ports all landing on one start would mean no randomness.
    assert!(starts.len() > 1, "every allocator started at {starts:?}");
}

#[test]
fn reassigning_ports_after_eaddrinuse_updates_dependents() {
    let hosts = HostResources::uniform(2, 8);
    let mut alloc = PortAllocator::preview();
    let mut p = place(
        &plan("sglang:(prefill:d1t16|decode:d1)+fsdp:d4"),
        &hosts,
        &mut alloc,
        &PlacementOptions::default(),
    );
    // 16-wide prefill takes both hosts; decode has no room.
    assert!(p.is_err());
    p = place(
        &plan("sglang:(prefill:d1t8|decode:d2)+fsdp:d4"),
        &hosts,
        &mut alloc,
        &PlacementOptions::default(),
    );
    let mut p = p.unwrap();
    let before: Vec<u16> = p
        .instances
        .iter()
        .filter(|e| e.host == 0)
        .flat_map(|e| e.ports.all())
        .collect();
    let fresh = p.reassign_ports(0, 0, 0, &hosts, &mut alloc).unwrap();
    assert!(fresh.bootstrap.is_some() && fresh.http.is_some() && fresh.dist.is_some());
    assert!(fresh.all().iter().all(|port| !before.contains(port)));
    let head = p.instance(0, 0, 0).next().unwrap();
    assert_eq!(head.ports, fresh);
    assert_eq!(
        head.dist_init_addr,
        Some(format!("host0:{}", fresh.dist.unwrap()))
    );
    // Training rank 0 gets a new rendezvous port; every rank follows it.
    let fresh = p.reassign_ports(1, 0, 0, &hosts, &mut alloc).unwrap();
    let addr = format!("host1:{}", fresh.dist.unwrap());
    assert!(
        p.instances
            .iter()
            .filter(|e| e.component == 1)
            .all(|e| e.dist_init_addr.as_deref() == Some(addr.as_str()))
    );
    // Rank 1 owns no ports; an unknown instance is reported, not panicked on.
    assert!(matches!(
        p.reassign_ports(1, 0, 1, &hosts, &mut alloc),
        Err(SchedulerError::Unknown { .. })
    ));
    assert!(p.reassign_ports(9, 9, 9, &hosts, &mut alloc).is_err());
}

#[test]
fn local_bind_probe_skips_a_port_in_use() {
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let busy = listener.local_addr().unwrap().port();
    let end = busy.saturating_add(20);
    let mut alloc =
        PortAllocator::new(PortRange::new(busy, end).unwrap(), Arc::new(LocalBindProbe));
    let host = HostResources::new(0, "127.0.0.1", vec![0]);
    let port = alloc.take(&host).unwrap();
    assert_ne!(port, busy);
    assert!(port > busy && port <= end);
    drop(listener);
}

#[test]
fn hosts_sharing_an_address_share_one_port_cursor() {
    // Two actor hosts on one machine: their servers must never get the same port.
    let hosts = vec![
        HostResources::new(0, "127.0.0.1", vec![0, 1]),
        HostResources::new(1, "127.0.0.1:9000", vec![0, 1]),
    ];
    let plan = AllocationPlan::parse("troupe:(prefill:d2t1|decode:d2t1)").unwrap();
    let mut alloc = PortAllocator::preview();
    let p = place(&plan, &hosts, &mut alloc, &PlacementOptions::default()).unwrap();
    let mut seen = std::collections::HashSet::new();
    for i in &p.instances {
        for port in [i.ports.http, i.ports.dist, i.ports.bootstrap]
            .into_iter()
            .flatten()
        {
            assert!(
                seen.insert(port),
                "port {port} handed out twice on one machine"
            );
        }
    }
    assert!(
        p.instances.iter().any(|i| i.host == 1),
        "both hosts are used"
    );
}
