//! Framed calls (`troupe_actors::framed`) on a `troupe host` subprocess: the controller's calls
//! keep their order and results over framed connections and over gRPC alike, and the host's
//! port refuses a wrong token, a bad frame and a silent client without serving anyone else less.

use crate::common;

use std::time::Duration;

use bytes::BytesMut;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use troupe_actors::builtin::diag::{Diag, DiagArgs, Echo, Info, Sleep};
use troupe_actors::framed::{self, encode_frame, take_frame};
use troupe_controller::{CallError, CallTransport, Cluster};
use troupe_wire::v1::{self, call_reply};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");
const TOKEN: &str = "framed-s3cret";

async fn host(calls: CallTransport) -> Cluster {
    Cluster::builder()
        .binary(BIN)
        .token(Some(TOKEN.into()))
        .calls(calls)
        .local_processes(1, 0)
        .await
        .unwrap()
}

/// Reads one reply frame, or `None` when the host closed the connection.
async fn read_reply(s: &mut TcpStream, inbox: &mut BytesMut) -> Option<v1::CallReply> {
    loop {
        if let Some(r) = take_frame::<v1::CallReply>(inbox, 1 << 20).unwrap() {
            return Some(r);
        }
        match s.read_buf(inbox).await {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

async fn hello(addr: &str, token: Option<&str>) -> (TcpStream, BytesMut, v1::CallReply) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&framed::hello(token)).await.unwrap();
    let mut inbox = BytesMut::new();
    let r = read_reply(&mut s, &mut inbox)
        .await
        .expect("the host answers a hello");
    (s, inbox, r)
}

#[tokio::test]
async fn calls_keep_order_results_and_failures_over_framed_connections_and_grpc() {
    within(90, async {
        for calls in [CallTransport::Framed, CallTransport::Grpc] {
            let c = host(calls).await;
            assert!(c.host(0).describe().await.unwrap().framed_calls);
            let a = c.host(0).spawn::<Diag>("a", &DiagArgs {}).await.unwrap();
            assert_eq!(a.call(Info).await.unwrap().pid, c.host(0).pid());
            // Pipelined: 10,000 calls in flight arrive in the order they were made.
            let futs: Vec<_> = (1..=10_000u64)
                .map(|seq| {
                    a.call(Echo {
                        seq,
                        body: "x".repeat((seq % 7) as usize * 1000),
                    })
                })
                .collect();
            for (i, r) in futures::future::join_all(futs)
                .await
                .into_iter()
                .enumerate()
            {
                assert_eq!(r.unwrap().prev_seq, i as u64, "{calls:?}: calls overtook");
            }
            // A payload much larger than a socket buffer goes through whole.
            let big = "y".repeat(8 << 20);
            let r = a
                .call(Echo {
                    seq: 1,
                    body: big.clone(),
                })
                .await
                .unwrap();
            assert_eq!(r.body.len(), big.len(), "{calls:?}");
            // A deadline is enforced by the host; the actor stays usable.
            let e = a
                .with_timeout(Duration::from_millis(100))
                .call(Sleep { ms: 5_000 })
                .await
                .unwrap_err();
            assert!(
                matches!(e, CallError::DeadlineExceeded(_)),
                "{calls:?}: {e}"
            );
            a.stop(Duration::from_secs(1)).await.unwrap();
            assert!(matches!(
                a.call(Info).await.unwrap_err(),
                CallError::UnknownActor(_)
            ));
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn the_port_refuses_wrong_tokens_bad_frames_and_silence_and_keeps_serving() {
    within(60, async {
        let c = host(CallTransport::Framed).await;
        let a = c.host(0).spawn::<Diag>("a", &DiagArgs {}).await.unwrap();
        let addr = c.host(0).address().to_string();

        // A client that connects and says nothing holds no one up.
        let _silent = TcpStream::connect(&addr).await.unwrap();

        for bad in [None, Some("wrong")] {
            let (mut s, mut inbox, r) = hello(&addr, bad).await;
            assert_eq!(r.call_id, 0);
            let Some(call_reply::Result::Error(e)) = r.result else {
                panic!("{bad:?} was accepted");
            };
            assert!(e.message.contains("token"), "{bad:?}: {}", e.message);
            assert!(
                read_reply(&mut s, &mut inbox).await.is_none(),
                "the host closes a refused connection"
            );
        }

        // Accepted: a call to an actor that does not exist answers with its call id.
        let (mut s, mut inbox, r) = hello(&addr, Some(TOKEN)).await;
        assert!(matches!(r.result, Some(call_reply::Result::Payload(_))));
        let mut out = Vec::new();
        encode_frame(
            &v1::CallRequest {
                actor_id: "nobody".into(),
                method: "m".into(),
                payload: vec![],
                call_id: 42,
                deadline_ms: 0,
            },
            &mut out,
        );
        s.write_all(&out).await.unwrap();
        let r = read_reply(&mut s, &mut inbox).await.unwrap();
        assert_eq!(r.call_id, 42);
        assert!(matches!(r.result, Some(call_reply::Result::Error(_))));

        // A frame announced over the host's limit closes that connection, without the host
        // allocating it; so does a frame that is not a CallRequest.
        s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(read_reply(&mut s, &mut inbox).await.is_none());
        let (mut s, mut inbox, _) = hello(&addr, Some(TOKEN)).await;
        s.write_all(&[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])
            .await
            .unwrap();
        assert!(read_reply(&mut s, &mut inbox).await.is_none());

        // Everyone else is served as before, over both protocols.
        a.call(Info).await.unwrap();
        assert_eq!(c.host(0).describe().await.unwrap().actors.len(), 1);
        c.shutdown().await;
    })
    .await
}

/// Reads until the peer closes the connection (EOF or reset); what arrived is discarded.
async fn closed(mut s: TcpStream) {
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

#[tokio::test]
async fn half_sent_hellos_and_prefaces_are_closed_and_capped_while_callers_are_served() {
    // The host's handshake timeout is 10 s and its cap on connections still to identify
    // themselves 256: every connection below is closed well within the test's deadline.
    within(90, async {
        let c = host(CallTransport::Framed).await;
        let a = c.host(0).spawn::<Diag>("a", &DiagArgs {}).await.unwrap();
        let addr = c.host(0).address().to_string();
        a.call(Info).await.unwrap();

        // A hello that announces a 4096-byte token and sends none of it, and an HTTP/2 preface
        // cut short.
        let mut partial_hello = framed::MAGIC.to_vec();
        partial_hello.extend_from_slice(&4096u32.to_le_bytes());
        let partial_preface = b"PRI * HTTP/2.0\r\n".to_vec();
        let mut held = Vec::new();
        for i in 0..280 {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            let first = if i % 2 == 0 {
                &partial_hello
            } else {
                &partial_preface
            };
            s.write_all(first).await.unwrap();
            held.push(tokio::spawn(closed(s)));
        }
        // Past the cap new connections are closed on arrival, and the calls of a connection
        // that authenticated before go on being answered meanwhile.
        let over = TcpStream::connect(&addr).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), closed(over))
            .await
            .expect("a connection over the cap is closed at once");
        for _ in 0..5 {
            a.call(Info).await.unwrap();
        }
        for h in held {
            h.await.unwrap();
        }
        // Once they are gone, new connections are served as before, over both protocols.
        let (_s, _inbox, r) = hello(&addr, Some(TOKEN)).await;
        assert!(matches!(r.result, Some(call_reply::Result::Payload(_))));
        assert_eq!(c.host(0).describe().await.unwrap().actors.len(), 1);
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn sequential_calls_are_answered_whole_while_the_host_polls_for_the_next() {
    within(90, async {
        use std::process::Stdio;
        // The widest window, so the host polls for every next call even in a debug build
        // (the default, 50 µs, is shorter than a debug build's round trip).
        let mut child = tokio::process::Command::new(BIN)
            .args(["host", "--listen", "127.0.0.1:0"])
            .env("TROUPE_TOKEN", TOKEN)
            .env(troupe_actors::idle_poll::HOST_POLL_ENV, "10000")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let addr = crate::common::procs::host_address(&mut child).await;
        let c = Cluster::builder()
            .token(Some(TOKEN.into()))
            .calls(CallTransport::Framed)
            .connect(&[addr])
            .await
            .unwrap();
        let a = c.host(0).spawn::<Diag>("a", &DiagArgs {}).await.unwrap();
        // One call at a time, as a training loop makes them: small ones, and ones larger than
        // a socket read (they arrive in pieces, the first of them read while polling).
        for seq in 1..=600u64 {
            let body = "z".repeat(if seq % 50 == 0 { 300_000 } else { 16 });
            let r = a
                .call(Echo {
                    seq,
                    body: body.clone(),
                })
                .await
                .unwrap();
            assert_eq!(
                (r.prev_seq, r.body.len()),
                (seq - 1, body.len()),
                "call {seq}"
            );
        }
        // A deadline still holds, and the connection goes on after it.
        let e = a
            .with_timeout(Duration::from_millis(100))
            .call(Sleep { ms: 5_000 })
            .await
            .unwrap_err();
        assert!(matches!(e, CallError::DeadlineExceeded(_)), "{e}");
        assert_eq!(a.call(Info).await.unwrap().pid, child.id().unwrap());
        c.shutdown().await;
    })
    .await
}
