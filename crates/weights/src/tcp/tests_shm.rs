//! Shared-memory ring tests over real loopback sockets and real `memfd` mappings: identical
//! bytes through a ring much smaller than a bucket (many laps), rings and a chain in one group,
//! an engine dying mid-bucket, and offers that must not be mapped.

use std::sync::Mutex;

use super::shm::{self, DEFAULT_RING_BYTES, MIN_RING_BYTES};
use super::tests_chain::{
    RecvTask, big_bucket, buckets_arrive_intact, group_with, refs, spawn_recv, specs, with_timeout,
};
use super::*;

/// `(group, rank)` pairs whose engine refuses the ring, as one that cannot map it would.
static REFUSING: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

/// Whether the engine of `rank` in `group` is set to refuse the ring.
pub(super) fn refuses_ring(group: &str, rank: u32) -> bool {
    REFUSING
        .lock()
        .map(|l| l.iter().any(|(g, r)| g == group && *r == rank))
        .unwrap_or(false)
}

fn refuse(group: &str, ranks: &[u32]) {
    let mut l = REFUSING.lock().unwrap();
    for &r in ranks {
        l.push((group.to_string(), r));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_on_this_machine_read_identical_bytes_from_the_ring() {
    with_timeout(async {
        // A 64 KiB ring against ~3.3 MB buckets: dozens of laps, so flow control is exercised.
        for (name, ring) in [("ring-small", MIN_RING_BYTES), ("ring", DEFAULT_RING_BYTES)] {
            let (mut sender, mut rxs) = group_with(&[1, 2, 1], name, Some(ring)).await;
            assert!(rxs.iter().all(|r| r.uses_shared_memory()), "{name}");
            assert_eq!(sender.shared_memory_receivers(), vec![1, 2, 4]);
            buckets_arrive_intact(&mut sender, &mut rxs, &[1, 2, 3]).await;
            sender.close().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_cannot_map_the_ring_form_a_chain_beside_it() {
    with_timeout(async {
        // Ranks 1, 2, 3-4, 5, 6; ranks 2 and 5 refuse, so they chain 0 -> 2 -> 5.
        refuse("mixed", &[2, 5]);
        let (mut sender, mut rxs) =
            group_with(&[1, 1, 2, 1, 1], "mixed", Some(MIN_RING_BYTES)).await;
        let on_ring: Vec<u32> = rxs
            .iter()
            .filter(|r| r.uses_shared_memory())
            .map(|r| r.rank())
            .collect();
        assert_eq!(on_ring, vec![1, 3, 6]);
        assert_eq!(sender.shared_memory_receivers(), vec![1, 3, 6]);
        let chained: Vec<(u32, u32, Option<u32>)> = rxs
            .iter()
            .filter(|r| !r.uses_shared_memory())
            .map(|r| (r.rank(), r.predecessor_rank(), r.successor_rank()))
            .collect();
        assert_eq!(chained, vec![(2, 0, Some(5)), (5, 2, None)]);
        buckets_arrive_intact(&mut sender, &mut rxs, &[1, 2, 3]).await;
        sender.close().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_shared_memory_every_engine_chains() {
    with_timeout(async {
        let (mut sender, mut rxs) = group_with(&[1, 1], "no-ring", None).await;
        assert!(rxs.iter().all(|r| !r.uses_shared_memory()));
        assert!(sender.shared_memory_receivers().is_empty());
        buckets_arrive_intact(&mut sender, &mut rxs, &[1, 2, 3]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_engine_dying_mid_bucket_is_named_everywhere() {
    with_timeout(async {
        let (mut sender, mut rxs) =
            group_with(&[1, 1, 1], "ring-death", Some(MIN_RING_BYTES)).await;
        rxs[1].die_after = Some(CHUNK_BYTES as u64);
        let b = big_bucket(7);
        let tasks: Vec<RecvTask> = rxs.drain(..).map(|rx| spawn_recv(rx, specs(&b))).collect();
        let sent = sender.send_bucket(&refs(&b)).await;
        assert!(
            matches!(sent, Err(TcpError::RankFailed { rank: 2, .. })),
            "sender: {sent:?}"
        );
        for t in tasks {
            let (me, _rx, got) = t.await.unwrap();
            if me == 2 {
                assert!(got.is_err());
                continue;
            }
            match got {
                Err(TcpError::RankFailed { rank, reason }) => {
                    assert_eq!(rank, 2, "rank {me} blamed {rank}: {reason}")
                }
                other => panic!("rank {me}: {other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refusing_a_bucket_fails_it_for_every_ring_engine_at_once() {
    // The refusing engine stops reading, so the ring fills and the others cannot finish; they
    // must hear the verdict well before the bucket's 300 s deadline (the test allows 60).
    with_timeout(async {
        let (mut sender, mut rxs) =
            group_with(&[1, 1, 1], "ring-refuse", Some(MIN_RING_BYTES)).await;
        let b = big_bucket(9);
        let mut tasks = Vec::new();
        for rx in rxs.drain(..) {
            let mut want = specs(&b);
            if rx.rank() == 2 {
                want[0].shape = vec![1024, 4096];
            }
            tasks.push(spawn_recv(rx, want));
        }
        let sent = sender.send_bucket(&refs(&b)).await;
        assert!(
            matches!(sent, Err(TcpError::RankFailed { rank: 2, ref reason }) if reason.contains("refused")),
            "sender: {sent:?}"
        );
        for t in tasks {
            let (me, _rx, got) = t.await.unwrap();
            match got {
                Err(TcpError::Protocol(m)) if me == 2 => assert!(m.contains("refused"), "{m}"),
                Err(TcpError::RankFailed { rank: 2, .. }) if me != 2 => {}
                other => panic!("rank {me}: {other:?}"),
            }
        }
    })
    .await;
}

#[test]
fn troupe_shm_disable_keeps_every_engine_on_the_chain() {
    use super::sender::ring_unless_disabled;
    assert_eq!(ring_unless_disabled(None), Some(DEFAULT_RING_BYTES));
    assert_eq!(ring_unless_disabled(Some("0")), Some(DEFAULT_RING_BYTES));
    assert_eq!(ring_unless_disabled(Some("1")), None);
    assert_eq!(ring_unless_disabled(Some(" 1\n")), None);
}

#[tokio::test]
async fn ring_sizes_out_of_range_are_refused_by_name() {
    let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
    for bad in [0, 10, MIN_RING_BYTES - 1, shm::MAX_RING_BYTES + 1] {
        match sender.set_shared_memory(Some(bad)) {
            Err(TcpError::InvalidArgument(m)) => assert!(m.contains("ring"), "{m}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    sender.set_shared_memory(None).unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn offers_that_are_not_rank_0s_ring_are_not_mapped() {
    let (_seg, offer) = shm::create(MIN_RING_BYTES).unwrap();
    assert!(shm::open(&offer).is_ok());
    let mut forged = offer.clone();
    forged.nonce[0] ^= 1;
    let e = shm::open(&forged).unwrap_err();
    assert!(e.contains("not rank 0's weight ring"), "{e}");
    let mut resized = offer.clone();
    resized.ring *= 2;
    let e = shm::open(&resized).unwrap_err();
    assert!(e.contains("is not the weight ring"), "{e}");
    let mut elsewhere = offer.clone();
    elsewhere.path = "/etc/hostname".into();
    let e = shm::open(&elsewhere).unwrap_err();
    assert!(e.contains("not a /proc descriptor path"), "{e}");
    elsewhere.path = "/proc/self/fd/999999".into();
    let e = shm::open(&elsewhere).unwrap_err();
    assert!(e.contains("cannot open"), "{e}");
    let mut huge = offer;
    huge.ring = u64::MAX;
    let e = shm::open(&huge).unwrap_err();
    assert!(e.contains("out of range"), "{e}");
}
