//! A gateway serving on threads of its own (`io_threads`, one single-threaded runtime each, as
//! `troupe gateway` runs): it forwards plain and streamed requests from many connections at
//! once, and its threads end with its handle, whether shut down or dropped. Its own test binary,
//! so the thread count it checks is its own.

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_serving::listen::IO_THREAD_PREFIX;

/// Threads of this process named `gateway-io-*` (Linux; elsewhere 0).
fn io_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with(IO_THREAD_PREFIX))
        })
        .count()
}

/// Polls until exactly `n` `gateway-io-*` threads run (a new thread names itself once it
/// runs), or fails after 10 s.
async fn threads_are(n: usize) {
    Poll::every(Duration::from_millis(20))
        .secs(10)
        .until(&format!("{n} gateway-io threads"), || async {
            io_threads() == n
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_its_own_threads_serves_and_its_threads_end_with_it() {
    within(60, async {
        let b = plain_and_stream(2).await;
        let cfg = GatewayConfig {
            workers: vec![WorkerSpec::regular(&b.url)],
            io_threads: 3,
            ..Default::default()
        };
        let g = gw_with(cfg.clone()).await;
        if cfg!(target_os = "linux") {
            threads_are(3).await;
        }
        // Many connections at once, spread over the threads by whichever accepts first.
        let url = g.url();
        let calls = (0..24).map(|i| {
            let url = url.clone();
            async move {
                // A fresh client per call: a connection of its own.
                let r = client()
                    .post(format!("{url}/generate"))
                    .json(&json!({"text": format!("x{i}")}))
                    .send()
                    .await
                    .expect("sent");
                (
                    r.status().as_u16(),
                    r.json::<serde_json::Value>().await.expect("json"),
                )
            }
        });
        for (st, v) in futures::future::join_all(calls).await {
            assert_eq!(st, 200, "{v}");
            assert_eq!(v, answer(2));
        }
        assert_eq!(b.count("/generate"), 24);
        let r = client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": "x", "stream": true}))
            .send()
            .await
            .expect("sent");
        assert_eq!(r.status(), 200);
        let text = r.text().await.expect("stream read");
        assert!(text.contains("data:"), "{text}");

        let addr = g.addr();
        g.shutdown().await.expect("clean shutdown");
        threads_are(0).await;
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "nothing listens after shutdown"
        );

        // Dropped without a shutdown: the threads still end.
        let g = gw_with(cfg).await;
        let (st, _) = post(&format!("{}/generate", g.url()), &json!({"text": "y"})).await;
        assert_eq!(st, 200);
        drop(g);
        threads_are(0).await;

        // A thread count nobody means is refused, by name, and starts nothing.
        let e = gateway::start(GatewayConfig {
            io_threads: 100_000,
            ..Default::default()
        })
        .await
        .expect_err("refused");
        assert!(e.to_string().contains("io_threads"), "{e}");
        assert_eq!(io_threads(), 0);
    })
    .await;
}
