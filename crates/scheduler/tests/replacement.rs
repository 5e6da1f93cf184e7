//! Re-placing a lost host's server instance: the placement's bundle rules, the freest live
//! host, fresh ports from the same cursor relay.

use std::collections::{BTreeMap, BTreeSet};

use troupe_scheduler::{
    AllocationPlan, HostResources, InstancePorts, Occupancy, Placement, PlacementOptions,
    PortAllocator, SchedulerError, WorkerType, place,
};

fn placed(mode: &str, hosts: &[HostResources]) -> (Placement, PortAllocator) {
    let mut ports = PortAllocator::preview();
    let plan = AllocationPlan::parse(mode).unwrap_or_else(|e| panic!("{e}"));
    let p = place(&plan, hosts, &mut ports, &PlacementOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    (p, ports)
}

fn lost(hosts: &[usize]) -> BTreeSet<usize> {
    hosts.iter().copied().collect()
}

fn used(pairs: &[(usize, &[u32])]) -> BTreeMap<usize, BTreeSet<u32>> {
    pairs
        .iter()
        .map(|(h, g)| (*h, g.iter().copied().collect()))
        .collect()
}

#[test]
fn a_lost_instance_takes_adjacent_gpus_on_the_freest_live_host() {
    let hosts = HostResources::uniform(3, 4);
    // Both instances on host 0 (GPUs 0-1 and 2-3); hosts 1 and 2 idle.
    let (p, mut ports) = placed("sglang:d2t2", &hosts);
    // Host 1 has three free GPUs (0, 2, 3), host 2 all four: the freest wins.
    let mut occupied = Occupancy {
        lost: lost(&[0]),
        used: used(&[(1, &[1])]),
    };
    let first = p.replace(0, 0, 0, &hosts, &occupied, &mut ports).unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!((first[0].host, first[0].gpus.clone()), (2, vec![0, 1]));
    // Now host 1 (3 free, adjacent 2-3) is freer than host 2 (2 free).
    occupied
        .used
        .entry(2)
        .or_default()
        .extend(first[0].gpus.iter().copied());
    let second = p.replace(0, 0, 1, &hosts, &occupied, &mut ports).unwrap();
    assert_eq!((second[0].host, second[0].gpus.clone()), (1, vec![2, 3]));
}

#[test]
fn free_gpus_that_are_not_adjacent_do_not_take_an_instance() {
    let hosts = HostResources::uniform(3, 4);
    let (p, mut ports) = placed("sglang:d2t2", &hosts);
    // Host 1 has two free GPUs, 1 and 3, not adjacent; host 2 only one.
    let occupied = Occupancy {
        lost: lost(&[0]),
        used: used(&[(1, &[0, 2]), (2, &[0, 1, 2])]),
    };
    let before = ports.clone();
    let err = p
        .replace(0, 0, 0, &hosts, &occupied, &mut ports)
        .unwrap_err();
    let SchedulerError::NoRoom { needed, shape, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!((*needed, shape.as_str()), (2, "adjacent on one live host"));
    let msg = err.to_string();
    assert!(
        msg.contains("host 1: 2") && !msg.contains("host 0"),
        "{msg}"
    );
    assert_eq!(
        ports.cursor(&hosts[1]),
        before.cursor(&hosts[1]),
        "a failed re-placement takes no port"
    );
}

#[test]
fn lost_hosts_are_never_chosen_however_free() {
    let hosts = HostResources::uniform(3, 4);
    let (p, mut ports) = placed("sglang:d1t1", &hosts);
    let occupied = Occupancy {
        lost: lost(&[0, 2]),
        used: p.gpus_in_use(),
    };
    let again = p.replace(0, 0, 0, &hosts, &occupied, &mut ports).unwrap();
    assert_eq!((again[0].host, again[0].gpus.clone()), (1, vec![0]));
    let occupied = Occupancy {
        lost: lost(&[0, 1, 2]),
        used: BTreeMap::new(),
    };
    assert!(matches!(
        p.replace(0, 0, 0, &hosts, &occupied, &mut ports),
        Err(SchedulerError::NoRoom { .. })
    ));
}

#[test]
fn the_head_gets_fresh_ports_of_the_same_shape_and_a_new_rendezvous() {
    let hosts = HostResources::uniform(2, 4);
    let (p, mut ports) = placed("sglang:(prefill:d1t1|decode:d1t1)", &hosts);
    let old: Vec<InstancePorts> = p.instances.iter().map(|e| e.ports).collect();
    let occupied = Occupancy {
        lost: lost(&[0]),
        used: p.gpus_in_use(),
    };
    let prefill = p.replace(0, 0, 0, &hosts, &occupied, &mut ports).unwrap();
    let e = &prefill[0];
    assert_eq!(
        (e.component, e.group, e.instance, e.worker_type),
        (0, 0, 0, WorkerType::Prefill)
    );
    assert_eq!(
        (e.host, e.gpus.clone(), e.address.as_str()),
        (1, vec![0], "host1")
    );
    assert_eq!(
        e.ports.needs(),
        old[0].needs(),
        "http, dist and bootstrap again"
    );
    // Both servers ran on host 0; host 1's cursor hands out its first ports.
    assert_eq!(
        (old[0].all(), e.ports.all()),
        (vec![10000, 10001, 10002], vec![10000, 10001, 10002])
    );
    assert_eq!(e.dist_init_addr, e.ports.dist.map(|d| format!("host1:{d}")));
    assert_eq!((e.node_rank, e.nnodes), (0, 1));
    let mut occupied = occupied;
    occupied.used.entry(1).or_default().insert(0);
    let decode = p.replace(0, 1, 0, &hosts, &occupied, &mut ports).unwrap();
    assert_eq!((decode[0].host, decode[0].gpus.clone()), (1, vec![1]));
    assert_eq!(
        decode[0].ports.all(),
        vec![10003, 10004],
        "the cursor continues; decode has no bootstrap port"
    );
    assert_eq!(
        p.instances[0].ports, old[0],
        "the placement itself is unchanged"
    );
}

#[test]
fn an_instance_wider_than_a_host_takes_whole_free_hosts_again() {
    let hosts = HostResources::uniform(5, 4);
    let (p, mut ports) = placed("sglang:d1t8", &hosts);
    assert_eq!(
        p.instances.iter().map(|e| e.host).collect::<Vec<_>>(),
        vec![0, 1]
    );
    // Host 1 is lost; host 2 is partly used, so hosts 3 and 4 take it.
    let occupied = Occupancy {
        lost: lost(&[1]),
        used: used(&[(0, &[0, 1, 2, 3]), (2, &[3])]),
    };
    let again = p.replace(0, 0, 0, &hosts, &occupied, &mut ports).unwrap();
    let shape: Vec<(usize, u32, u32, Vec<u32>)> = again
        .iter()
        .map(|e| (e.host, e.node_rank, e.nnodes, e.gpus.clone()))
        .collect();
    assert_eq!(
        shape,
        vec![(3, 0, 2, vec![0, 1, 2, 3]), (4, 1, 2, vec![0, 1, 2, 3])]
    );
    assert!(again[0].ports.http.is_some() && again[1].ports == InstancePorts::default());
    assert_eq!(again[1].dist_init_addr, again[0].dist_init_addr);
    // Only one whole free host left: no room.
    let occupied = Occupancy {
        lost: lost(&[1]),
        used: used(&[(0, &[0]), (2, &[3]), (3, &[0])]),
    };
    let err = p
        .replace(0, 0, 0, &hosts, &occupied, &mut ports)
        .unwrap_err();
    assert!(
        err.to_string().contains("on 2 whole free hosts of 4 GPUs"),
        "{err}"
    );
}

#[test]
fn only_placed_server_instances_are_re_placed() {
    let hosts = HostResources::uniform(2, 4);
    let (p, mut ports) = placed("sglang:d1t1+fsdp:d2", &hosts);
    let occupied = Occupancy {
        lost: lost(&[0]),
        used: p.gpus_in_use(),
    };
    let err = p
        .replace(1, 0, 0, &hosts, &occupied, &mut ports)
        .unwrap_err();
    assert!(err.to_string().contains("training rank"), "{err}");
    let err = p
        .replace(0, 0, 7, &hosts, &occupied, &mut ports)
        .unwrap_err();
    assert!(err.to_string().contains("is not placed"), "{err}");
}
