//! Chain broadcast tests over real loopback sockets: identical bytes at every engine for chains
//! of 1, 3 and 5 engines (some covering several TP ranks), a receiver dying mid-transfer, and
//! malformed handshakes.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use std::sync::Arc;

use super::auth::GroupSecret;
use super::frame::read_status;
use super::join::{Hello, send_join};
use super::link::{accept_link, connect_link};
use super::*;

pub(super) const T: Duration = Duration::from_secs(20);

pub(super) async fn with_timeout<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test timed out")
}

/// A chain-only group whose engines cover `layout[i]` ranks each; engines join in reverse
/// order so the chain order (ascending rank) is not the join order. Receivers come back sorted
/// by rank.
async fn group(layout: &[u32]) -> (WeightSender, Vec<WeightReceiver>) {
    group_with(layout, "chain", None).await
}

/// As [`group`], named `name`, offering a shared-memory ring of `ring` bytes (`None`: none).
pub(super) async fn group_with(
    layout: &[u32],
    name: &'static str,
    ring: Option<usize>,
) -> (WeightSender, Vec<WeightReceiver>) {
    let world = 1 + layout.iter().sum::<u32>() as usize;
    let mut sender = WeightSender::bind("127.0.0.1:0", world, name)
        .await
        .unwrap();
    sender.set_shared_memory(ring).unwrap();
    let addr = sender.local_addr().unwrap().to_string();
    let key = sender.secret();
    let mut offset = 1;
    let mut joins = Vec::new();
    for &n in layout {
        let (addr, key, rank) = (addr.clone(), key.clone(), offset);
        joins.push(tokio::spawn(async move {
            WeightReceiver::connect(&addr, name, &key, rank, n, T).await
        }));
        offset += n;
    }
    joins.reverse();
    sender.accept_all(T).await.unwrap();
    let mut rxs = Vec::new();
    for j in joins {
        rxs.push(j.await.unwrap().unwrap());
    }
    rxs.sort_by_key(|r| r.rank());
    (sender, rxs)
}

/// Deterministic bytes that differ per tensor and per position.
pub(super) fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

pub(super) struct Owned {
    pub(super) name: String,
    pub(super) dtype: WireDtype,
    pub(super) shape: Vec<usize>,
    pub(super) bytes: Vec<u8>,
}

/// A bucket spanning several chunks, with odd sizes and an empty tensor.
pub(super) fn bucket(seed: u32) -> Vec<Owned> {
    let mk = |name: &str, dtype: WireDtype, shape: Vec<usize>, s: u32| {
        let len = shape.iter().product::<usize>() * dtype.elem_size();
        Owned {
            name: name.into(),
            dtype,
            shape,
            bytes: pattern(seed * 10 + s, len),
        }
    };
    vec![
        mk("big.weight", WireDtype::F32, vec![1024, 777], 1),
        mk("odd.weight", WireDtype::Bf16, vec![333, 7], 2),
        mk("q.weight", WireDtype::F8E4M3, vec![129, 300], 3),
        mk("empty", WireDtype::F32, vec![0], 4),
        mk("norm.weight", WireDtype::Bf16, vec![64], 5),
    ]
}

/// [`bucket`] with a 16 MiB first tensor: large enough that an engine failing early leaves
/// most of the bucket still to come.
pub(super) fn big_bucket(seed: u32) -> Vec<Owned> {
    let mut b = bucket(seed);
    b[0].shape = vec![4096, 1024];
    b[0].bytes = pattern(seed * 10 + 9, 4096 * 1024 * 4);
    b
}

pub(super) fn refs(b: &[Owned]) -> Vec<TensorRef<'_>> {
    b.iter()
        .map(|t| TensorRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &t.bytes,
        })
        .collect()
}

pub(super) fn specs(b: &[Owned]) -> Vec<TensorSpec> {
    b.iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect()
}

pub(super) type RecvTask = tokio::task::JoinHandle<(
    u32,
    Option<WeightReceiver>,
    Result<Vec<OwnedTensor>, TcpError>,
)>;

/// Receives one bucket; a receiver set to die is dropped (all its sockets closed, as when the
/// process is killed) the moment it stops.
pub(super) fn spawn_recv(mut rx: WeightReceiver, expected: Vec<TensorSpec>) -> RecvTask {
    tokio::spawn(async move {
        let r = rx.recv_bucket(&expected, T).await;
        let rank = rx.rank();
        let rx = if rx.die_after.is_some() {
            None
        } else {
            Some(rx)
        };
        (rank, rx, r)
    })
}

async fn chain_delivers_identical_bytes(layout: &[u32]) {
    let (mut sender, mut rxs) = group(layout).await;
    // The chain runs in ascending rank order; each engine is one hop whatever its TP size.
    let mut pred = 0;
    for (i, r) in rxs.iter().enumerate() {
        assert_eq!(r.predecessor_rank(), pred);
        assert_eq!(r.successor_rank(), rxs.get(i + 1).map(|n| n.rank()));
        pred = r.rank();
    }
    let mut ranks = sender.receivers();
    ranks.sort();
    assert_eq!(
        ranks,
        rxs.iter()
            .map(|r| (r.rank(), r.n_ranks()))
            .collect::<Vec<_>>()
    );
    // Two buckets in a row: the links stay aligned across bucket boundaries.
    buckets_arrive_intact(&mut sender, &mut rxs, &[1, 2]).await;
    sender.close().await.unwrap();
}

/// Sends one bucket per seed and checks every engine got each byte for byte.
pub(super) async fn buckets_arrive_intact(
    sender: &mut WeightSender,
    rxs: &mut Vec<WeightReceiver>,
    seeds: &[u32],
) {
    for &seed in seeds {
        let b = bucket(seed);
        let tasks: Vec<RecvTask> = rxs.drain(..).map(|rx| spawn_recv(rx, specs(&b))).collect();
        sender.send_bucket(&refs(&b)).await.unwrap();
        for t in tasks {
            let (rank, rx, got) = t.await.unwrap();
            let got = got.unwrap();
            assert_eq!(got.len(), b.len());
            for (g, want) in got.iter().zip(&b) {
                assert_eq!(
                    (&g.name, g.dtype, &g.shape),
                    (&want.name, want.dtype, &want.shape)
                );
                assert!(g.bytes == want.bytes, "rank {rank}: {} differs", g.name);
            }
            rxs.extend(rx);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_receiver_gets_identical_bytes() {
    with_timeout(chain_delivers_identical_bytes(&[1])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_receivers_with_tp_get_identical_bytes() {
    with_timeout(chain_delivers_identical_bytes(&[2, 1, 4])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_receivers_with_tp_get_identical_bytes() {
    with_timeout(chain_delivers_identical_bytes(&[1, 2, 1, 1, 2])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_dying_mid_transfer_is_named_everywhere() {
    with_timeout(async {
        let (mut sender, mut rxs) = group(&[1, 2, 1, 1, 1]).await;
        let victim = rxs[2].rank();
        assert_eq!(victim, 4);
        rxs[2].die_after = Some(CHUNK_BYTES as u64);
        let b = big_bucket(3);
        let tasks: Vec<RecvTask> = rxs.drain(..).map(|rx| spawn_recv(rx, specs(&b))).collect();
        let sent = sender.send_bucket(&refs(&b)).await;
        assert!(
            matches!(sent, Err(TcpError::RankFailed { rank: 4, .. })),
            "sender: {sent:?}"
        );
        for t in tasks {
            let (me, _rx, got) = t.await.unwrap();
            if me == victim {
                assert!(got.is_err());
                continue;
            }
            match got {
                Err(TcpError::RankFailed { rank, reason }) => {
                    assert_eq!(rank, victim, "rank {me} blamed {rank}: {reason}")
                }
                other => panic!("rank {me}: {other:?}"),
            }
        }
        // The group is unusable afterwards, and says why.
        let again = sender.send_bucket(&refs(&b)).await;
        assert!(
            matches!(again, Err(TcpError::RankFailed { rank: 4, ref reason }) if reason.contains("re-create") || reason.contains("create a new")),
            "{again:?}"
        );
    })
    .await;
}

/// Connects to the sender and writes `hello`, returning the sender's verdict.
async fn raw_hello(addr: &str, hello: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(hello).await.unwrap();
    read_status(&mut s).await.unwrap()
}

#[tokio::test]
async fn bad_handshakes_are_rejected_with_a_reason() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        let accept = tokio::spawn(async move {
            let r = sender.accept_all(T).await;
            (sender, r)
        });
        let http = raw_hello(&addr, b"GET / HTTP/1.1\r\n\r\n")
            .await
            .unwrap_err();
        assert!(
            http.contains("bad handshake") && http.contains("magic"),
            "{http}"
        );
        let mut v1 = MAGIC.to_vec();
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.extend_from_slice(&[0; 12]);
        let old = raw_hello(&addr, &v1).await.unwrap_err();
        assert!(
            old.contains("version 1") && old.contains(&format!("speaks {VERSION}")),
            "{old}"
        );
        let bad_addr = Hello {
            rank: 1,
            n_ranks: 1,
            group: "g".into(),
            data_addr: "nowhere".into(),
            digest: 0,
        };
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let no_addr = send_join(&mut s, &GroupSecret::parse(&key).unwrap(), &bad_addr, &addr)
            .await
            .unwrap_err()
            .to_string();
        assert!(no_addr.contains("\"nowhere\" is not ip:port"), "{no_addr}");
        // The wait went on: a real engine still joins and the group forms.
        let good = WeightReceiver::connect(&addr, "g", &key, 1, 1, T)
            .await
            .unwrap();
        let (_sender, r) = accept.await.unwrap();
        r.unwrap();
        assert_eq!(good.predecessor_rank(), 0);
        assert_eq!(good.successor_rank(), None);
    })
    .await;
}

#[tokio::test]
async fn data_links_refuse_strangers_and_wait_for_the_real_predecessor() {
    with_timeout(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let deadline = tokio::time::Instant::now() + T;
        let secret = Arc::new(GroupSecret::generate().unwrap());
        let stranger = GroupSecret::generate().unwrap();
        let acc = tokio::spawn({
            let secret = secret.clone();
            async move {
                let s = accept_link(&listener, secret, 3, 5, deadline).await;
                s.map(|mut s| async move {
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b).await.map(|_| b[0])
                })
            }
        });
        let wrong_secret = connect_link(&addr, &stranger, 3, 5, deadline)
            .await
            .unwrap_err();
        assert!(
            wrong_secret
                .to_string()
                .contains("does not prove this group's secret"),
            "{wrong_secret}"
        );
        let wrong_rank = connect_link(&addr, &secret, 2, 5, deadline)
            .await
            .unwrap_err();
        assert!(
            wrong_rank
                .to_string()
                .contains("expects its data link from rank 3"),
            "{wrong_rank}"
        );
        let mut ok = connect_link(&addr, &secret, 3, 5, deadline).await.unwrap();
        ok.write_all(&[9]).await.unwrap();
        assert_eq!(acc.await.unwrap().unwrap().await.unwrap(), 9);
    })
    .await;
}
