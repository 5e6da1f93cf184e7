//! Transport tests over real loopback sockets.

use super::frame::encode_header;
use super::*;
use std::time::Duration;

fn spec(name: &str, dtype: WireDtype, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

async fn with_timeout<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test timed out")
}

#[tokio::test]
async fn two_receivers_get_identical_buckets_in_order() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 4, "g").await.unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        // Receiver A covers ranks 1..3 (TP 2), receiver B covers rank 3.
        let a = tokio::spawn({
            let (addr, key) = (addr.clone(), key.clone());
            async move { WeightReceiver::connect(&addr, "g", &key, 1, 2, Duration::from_secs(5)).await }
        });
        let b = tokio::spawn({
            let (addr, key) = (addr.clone(), key.clone());
            async move { WeightReceiver::connect(&addr, "g", &key, 3, 1, Duration::from_secs(5)).await }
        });
        sender.accept_all(Duration::from_secs(5)).await.unwrap();
        let mut a = a.await.unwrap().unwrap();
        let mut b = b.await.unwrap().unwrap();
        let mut rs = sender.receivers();
        rs.sort();
        assert_eq!(rs, vec![(1, 2), (3, 1)]);

        let w: Vec<u8> = (0..24u8).collect();
        let s: Vec<u8> = vec![7, 8];
        let fp8: Vec<u8> = vec![0x38, 0xb8, 0x00];
        let bucket = [
            TensorRef {
                name: "w",
                dtype: WireDtype::F32,
                shape: &[2, 3],
                bytes: &w,
            },
            TensorRef {
                name: "s",
                dtype: WireDtype::Bf16,
                shape: &[1],
                bytes: &s,
            },
            TensorRef {
                name: "q",
                dtype: WireDtype::F8E4M3,
                shape: &[3],
                bytes: &fp8,
            },
        ];
        let expected = vec![
            spec("w", WireDtype::F32, &[2, 3]),
            spec("s", WireDtype::Bf16, &[1]),
            spec("q", WireDtype::F8E4M3, &[3]),
        ];
        let ra = tokio::spawn(async move {
            let r = a.recv_bucket(&expected, Duration::from_secs(5)).await;
            (a, r)
        });
        let rb = tokio::spawn(async move {
            let exp = vec![
                spec("w", WireDtype::F32, &[2, 3]),
                spec("s", WireDtype::Bf16, &[1]),
                spec("q", WireDtype::F8E4M3, &[3]),
            ];
            b.recv_bucket(&exp, Duration::from_secs(5)).await
        });
        sender.send_bucket(&bucket).await.unwrap();
        let (_a, got_a) = ra.await.unwrap();
        let got_a = got_a.unwrap();
        let got_b = rb.await.unwrap().unwrap();
        assert_eq!(got_a, got_b);
        assert_eq!(got_a[0].bytes, w);
        assert_eq!(got_a[1].bytes, s);
        assert_eq!(got_a[2].bytes, fp8);
        assert_eq!(got_a[2].dtype, WireDtype::F8E4M3);
    })
    .await;
}

#[tokio::test]
async fn wrong_group_and_overlapping_ranks_are_rejected() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 2, "right").await.unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        let bad = tokio::spawn({
            let (addr, key) = (addr.clone(), key.clone());
            async move {
                WeightReceiver::connect(&addr, "wrong", &key, 1, 1, Duration::from_secs(5)).await
            }
        });
        let accept = tokio::spawn(async move {
            let r = sender.accept_all(Duration::from_secs(5)).await;
            (sender, r)
        });
        let err = bad.await.unwrap().unwrap_err();
        assert!(
            matches!(err, TcpError::Rejected(ref m) if m.contains("wrong")),
            "{err}"
        );
        let out_of_range =
            WeightReceiver::connect(&addr, "right", &key, 1, 5, Duration::from_secs(5)).await;
        assert!(matches!(out_of_range, Err(TcpError::Rejected(_))));
        let good = WeightReceiver::connect(&addr, "right", &key, 1, 1, Duration::from_secs(5))
            .await
            .unwrap();
        let (_sender, r) = accept.await.unwrap();
        r.unwrap();
        assert_eq!(good.rank(), 1);
    })
    .await;
}

#[tokio::test]
async fn mismatched_bucket_is_refused_on_both_sides() {
    with_timeout(async {
        let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
        let addr = sender.local_addr().unwrap().to_string();
        let key = sender.secret();
        let rx = tokio::spawn(async move {
            WeightReceiver::connect(&addr, "g", &key, 1, 1, Duration::from_secs(5)).await
        });
        sender.accept_all(Duration::from_secs(5)).await.unwrap();
        let mut rx = rx.await.unwrap().unwrap();
        let recv = tokio::spawn(async move {
            let exp = vec![spec("a", WireDtype::F32, &[2])];
            rx.recv_bucket(&exp, Duration::from_secs(5)).await
        });
        let bytes = [0u8; 8];
        let sent = sender
            .send_bucket(&[TensorRef {
                name: "b",
                dtype: WireDtype::F32,
                shape: &[2],
                bytes: &bytes,
            }])
            .await;
        assert!(
            matches!(sent, Err(TcpError::RankFailed { rank: 1, ref reason }) if reason.contains("expected a")),
            "{sent:?}"
        );
        let got = recv.await.unwrap();
        assert!(
            matches!(got, Err(TcpError::Protocol(ref m)) if m.contains("rank 1") && m.contains("sender sent b")),
            "{got:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn bad_arguments_send_nothing() {
    with_timeout(async {
        assert!(matches!(
            WeightSender::bind("127.0.0.1:0", 1, "g").await,
            Err(TcpError::InvalidArgument(_))
        ));
        let bytes = [0u8; 3];
        let err = encode_header(&TensorRef {
            name: "x",
            dtype: WireDtype::Bf16,
            shape: &[2],
            bytes: &bytes,
        });
        assert!(matches!(err, Err(TcpError::InvalidArgument(_))));
        let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
        let t = sender.accept_all(Duration::from_millis(100)).await;
        assert!(matches!(t, Err(TcpError::Timeout(_))));
    })
    .await;
}

#[test]
fn dtype_spellings() {
    assert_eq!(WireDtype::parse("torch.bfloat16"), Some(WireDtype::Bf16));
    assert_eq!(WireDtype::parse("float32"), Some(WireDtype::F32));
    assert_eq!(WireDtype::parse("float8_e4m3fn"), Some(WireDtype::F8E4M3));
    assert_eq!(WireDtype::parse("int8"), None);
}
