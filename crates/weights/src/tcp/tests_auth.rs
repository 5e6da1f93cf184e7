//! Strangers on the weight transport: a peer that knows rank 0's port and the group name (or
//! sends an empty one) but not the group secret never takes a rank, and a peer that connects
//! and says nothing (to rank 0 or to an engine's data port) holds up no join and no link.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::auth::GroupSecret;
use super::tests_chain::with_timeout;
use super::*;

/// What every join and bucket here must fit in: well under the 10 s a handshake may take, so
/// waiting out one silent peer fails the test.
const WITHIN: Duration = Duration::from_secs(5);

/// Data listeners a test wants a silent stranger connected to: `(group, rank)`, and the
/// strangers' sockets (kept open for the test's life).
static SILENT_AT: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());
static SILENT: Mutex<Vec<std::net::TcpStream>> = Mutex::new(Vec::new());

/// Receiver hook: the engine of `rank` in `group` has bound its data listener at `addr` (before
/// it joins); connects a silent stranger there if a test asked for one.
pub(super) fn data_listener_bound(group: &str, rank: u32, addr: &str) {
    let wanted = SILENT_AT
        .lock()
        .map(|l| l.iter().any(|(g, r)| g == group && *r == rank))
        .unwrap_or(false);
    if wanted
        && let Ok(s) = std::net::TcpStream::connect(addr)
        && let Ok(mut l) = SILENT.lock()
    {
        l.push(s);
    }
}

fn spec(name: &str, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype: WireDtype::F32,
        shape: shape.to_vec(),
    }
}

/// Joins engines of one rank each at ranks `ranks` (all with `group` and `key`) while rank 0
/// admits them within [`WITHIN`]; the receivers in rank order.
async fn join(
    sender: &mut WeightSender,
    group: &'static str,
    key: &str,
    ranks: &[u32],
) -> Vec<WeightReceiver> {
    let addr = sender.local_addr().unwrap().to_string();
    let joins: Vec<_> = ranks
        .iter()
        .map(|&r| {
            let (addr, key) = (addr.clone(), key.to_string());
            tokio::spawn(
                async move { WeightReceiver::connect(&addr, group, &key, r, 1, WITHIN).await },
            )
        })
        .collect();
    sender.accept_all(WITHIN).await.unwrap();
    let mut rxs = Vec::new();
    for j in joins {
        rxs.push(j.await.unwrap().unwrap());
    }
    rxs
}

/// Sends one bucket of two tensors and checks every receiver got exactly its bytes.
async fn sync_one(sender: &mut WeightSender, rxs: Vec<WeightReceiver>) {
    let a: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let b: Vec<u8> = (0..64u8).rev().collect();
    let recvs: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            tokio::spawn(async move {
                let exp = [spec("a", &[1024]), spec("b", &[16])];
                rx.recv_bucket(&exp, WITHIN).await
            })
        })
        .collect();
    let bucket = [
        TensorRef {
            name: "a",
            dtype: WireDtype::F32,
            shape: &[1024],
            bytes: &a,
        },
        TensorRef {
            name: "b",
            dtype: WireDtype::F32,
            shape: &[16],
            bytes: &b,
        },
    ];
    sender.send_bucket(&bucket).await.unwrap();
    for r in recvs {
        let got = r.await.unwrap().unwrap();
        assert_eq!(got[0].bytes, a);
        assert_eq!(got[1].bytes, b);
    }
}

#[tokio::test]
async fn a_stranger_who_knows_port_and_group_but_not_the_secret_takes_no_rank() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 3, "auth-a")
            .await
            .unwrap();
        sender.set_shared_memory(None).unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        let wrong = GroupSecret::generate().unwrap().to_hex();
        // The stranger asks first, for the rank the real engine will want.
        let stranger = WeightReceiver::connect(&addr, "auth-a", &wrong, 1, 1, WITHIN);
        let (stranger, rxs) = tokio::join!(stranger, join(&mut sender, "auth-a", &key, &[1, 2]));
        match stranger {
            Err(TcpError::Rejected(m)) => {
                assert!(m.contains("does not prove this group's secret"), "{m}")
            }
            other => panic!("the stranger was not refused: {other:?}"),
        }
        let mut ranks = sender.receivers();
        ranks.sort();
        assert_eq!(ranks, vec![(1, 1), (2, 1)]);
        sync_one(&mut sender, rxs).await;
        // A join that brings no secret is refused before anything is sent.
        for missing in ["", "not-hex"] {
            match WeightReceiver::connect(&addr, "auth-a", missing, 1, 1, WITHIN).await {
                Err(TcpError::InvalidArgument(m)) => assert!(m.contains("group secret"), "{m}"),
                other => panic!("{missing:?}: {other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn an_empty_group_name_joins_only_with_the_secret() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 2, "auth-d")
            .await
            .unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        let wrong = GroupSecret::generate().unwrap().to_hex();
        let stranger = WeightReceiver::connect(&addr, "", &wrong, 1, 1, WITHIN);
        let (stranger, rxs) = tokio::join!(stranger, join(&mut sender, "", &key, &[1]));
        assert!(
            matches!(stranger, Err(TcpError::Rejected(ref m)) if m.contains("secret")),
            "{stranger:?}"
        );
        assert_eq!(rxs[0].group_name(), "");
        sync_one(&mut sender, rxs).await;
    })
    .await;
}

#[tokio::test]
async fn silent_strangers_at_rank_0_delay_no_join() {
    with_timeout(async {
        let started = Instant::now();
        let mut sender = WeightSender::bind("127.0.0.1:0", 3, "auth-b")
            .await
            .unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        // More silent connections than handshakes read at once, all before the real engines.
        let mut silent = Vec::new();
        for _ in 0..80 {
            silent.push(TcpStream::connect(&addr).await.unwrap());
        }
        let rxs = join(&mut sender, "auth-b", &key, &[1, 2]).await;
        sync_one(&mut sender, rxs).await;
        assert!(started.elapsed() < WITHIN, "{:?}", started.elapsed());
        drop(silent);
    })
    .await;
}

#[tokio::test]
async fn a_silent_stranger_at_an_engine_data_port_stalls_no_chain() {
    with_timeout(async {
        let started = Instant::now();
        if let Ok(mut l) = SILENT_AT.lock() {
            l.extend([1, 2, 3].map(|r| ("auth-c".to_string(), r)));
        }
        let mut sender = WeightSender::bind("127.0.0.1:0", 4, "auth-c")
            .await
            .unwrap();
        // Every engine on the chain, so each one accepts a data link from its predecessor.
        sender.set_shared_memory(None).unwrap();
        let key = sender.secret();
        let rxs = join(&mut sender, "auth-c", &key, &[1, 2, 3]).await;
        assert_eq!(
            rxs.iter().map(|r| r.predecessor_rank()).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        sync_one(&mut sender, rxs).await;
        assert!(started.elapsed() < WITHIN, "{:?}", started.elapsed());
    })
    .await;
}

#[tokio::test]
async fn an_engine_refuses_a_rank_0_that_does_not_hold_the_secret() {
    with_timeout(async {
        let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = fake.local_addr().unwrap().to_string();
        let impostor = tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            let mut start = [0u8; 6];
            s.read_exact(&mut start).await.unwrap();
            let mut challenge = vec![0u8];
            challenge.extend_from_slice(&[7; 32]);
            s.write_all(&challenge).await.unwrap();
            let mut join = [0u8; 64];
            let _ = s.read(&mut join).await.unwrap();
            let mut admit = vec![0u8];
            admit.extend_from_slice(&[9; 32]);
            s.write_all(&admit).await.unwrap();
            s
        });
        let key = GroupSecret::generate().unwrap().to_hex();
        let got = WeightReceiver::connect(&addr, "g", &key, 1, 1, WITHIN).await;
        assert!(
            matches!(got, Err(TcpError::Rejected(ref m)) if m.contains("not this group's rank 0")),
            "{got:?}"
        );
        drop(impostor.await.unwrap());
    })
    .await;
}
