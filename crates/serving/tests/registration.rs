//! Worker registration (`POST /workers`, the gateway's configured workers): URLs with
//! credentials are refused, one server is one worker whatever the URL's spelling, and a server
//! that reports another role in its `/server_info` than the one it is registered as is refused.

use crate::support;

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

/// A fake server that reports `mode` as its `disaggregation_mode` on `info_path`, like SGLang
/// and the reference engine, and 404 on the other info path.
async fn reporting(mode: Value, info_path: &'static str) -> Fake {
    fake(move |path, _, _| {
        if path == info_path {
            Reply::Json(
                StatusCode::OK,
                json!({"disaggregation_mode": mode, "tp_size": 1}),
            )
        } else if path.contains("server_info") {
            Reply::Json(StatusCode::NOT_FOUND, json!({}))
        } else {
            Reply::Json(StatusCode::OK, answer(1))
        }
    })
    .await
}

async fn add(gw: &str, body: Value) -> (u16, Value) {
    post(&format!("{gw}/workers"), &body).await
}

fn port_of(url: &str) -> &str {
    url.rsplit(':').next().unwrap_or("")
}

#[tokio::test]
async fn urls_with_credentials_are_refused() {
    within(20, async {
        let g = gw(false, vec![], 0).await;
        for url in [
            "http://user:pass@127.0.0.1:30000",
            "http://admin@localhost:30000/",
        ] {
            let (st, v) = add(&g.url(), json!({"url": url})).await;
            assert_eq!(st, 400, "{url}: {v}");
            assert_envelope(&v, 400);
            let msg = v["message"].as_str().unwrap_or("");
            assert!(msg.contains("credentials"), "{msg}");
            assert!(msg.contains("/metrics"), "says why: {msg}");
        }
        assert_eq!(get(&format!("{}/workers", g.url())).await.1["total"], 0);

        let cfg = GatewayConfig {
            workers: vec![WorkerSpec::regular("http://u:p@127.0.0.1:1")],
            ..Default::default()
        };
        let e = gateway::start(cfg).await.expect_err("refused at start");
        assert!(e.to_string().contains("credentials"), "{e}");
    })
    .await;
}

#[tokio::test]
async fn one_server_is_one_worker_whatever_the_spelling() {
    within(20, async {
        let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
        let port = port_of(&b.url);
        let g = gw(false, vec![], 0).await;
        let (st, v) = add(
            &g.url(),
            json!({"url": format!("http://localhost:{port}/")}),
        )
        .await;
        assert_eq!(st, 202, "{v}");
        assert_eq!(
            v["url"],
            format!("http://127.0.0.1:{port}"),
            "stored canonical"
        );
        for dup in [
            format!("http://127.0.0.1:{port}"),
            format!("http://127.0.0.1:{port}//"),
            format!("HTTP://LocalHost:{port}"),
            format!("http://[::ffff:127.0.0.1]:{port}"),
        ] {
            let (st, v) = add(&g.url(), json!({"url": dup})).await;
            assert_eq!(st, 400, "{dup}: {v}");
            assert_envelope(&v, 400);
            let msg = v["message"].as_str().unwrap_or("");
            assert!(msg.contains("already registered"), "{msg}");
            assert!(
                msg.contains("DELETE /workers/"),
                "says how to fix it: {msg}"
            );
        }
        let (_, list) = get(&format!("{}/workers", g.url())).await;
        assert_eq!(list["total"], 1, "{list}");
        // Any spelling finds it, and removes it.
        let (st, _) = get(&format!(
            "{}/workers/http%3A%2F%2Flocalhost%3A{port}",
            g.url()
        ))
        .await;
        assert_eq!(st, 200);
        let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
        assert_eq!(st, 200, "{v}");

        // In PD mode one URL cannot be both a prefill and a decode.
        let pd = gw(true, vec![], 0).await;
        let (st, _) = add(&pd.url(), json!({"url": b.url, "worker_type": "prefill"})).await;
        assert_eq!(st, 202);
        let (st, v) = add(
            &pd.url(),
            json!({"url": format!("http://localhost:{port}"), "worker_type": "decode"}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["message"].as_str().unwrap_or("").contains("prefill"),
            "{v}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_server_reporting_another_role_is_refused() {
    within(20, async {
        let prefill = reporting(json!("prefill"), "/server_info").await;
        let decode_old = reporting(json!("decode"), "/get_server_info").await;
        let regular = reporting(json!("null"), "/server_info").await;
        let pd = gw(true, vec![], 0).await;

        let (st, v) = add(
            &pd.url(),
            json!({"url": prefill.url, "worker_type": "decode"}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_envelope(&v, 400);
        let msg = v["message"].as_str().unwrap_or("");
        assert!(
            msg.contains("registered as a decode") && msg.contains("it is a prefill server"),
            "names both types: {msg}"
        );
        assert_eq!(prefill.count("/server_info"), 1, "asked the server itself");

        // The older /get_server_info is asked when /server_info is missing.
        let (st, v) = add(
            &pd.url(),
            json!({"url": decode_old.url, "worker_type": "prefill"}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["message"]
                .as_str()
                .unwrap_or("")
                .contains("it is a decode server"),
            "{v}"
        );

        for (w, t) in [(&prefill, "prefill"), (&decode_old, "decode")] {
            let (st, v) = add(&pd.url(), json!({"url": w.url, "worker_type": t})).await;
            assert_eq!(st, 202, "{t}: {v}");
        }
        let (st, v) = post(&format!("{}/generate", pd.url()), &json!({"text": "x"})).await;
        assert_eq!(st, 200, "{v}");

        // A regular server ("null") is not a decode, and a decode is not regular.
        let (st, _) = add(
            &pd.url(),
            json!({"url": regular.url, "worker_type": "decode"}),
        )
        .await;
        assert_eq!(st, 400);
        let plain = gw(false, vec![], 0).await;
        let (st, v) = add(&plain.url(), json!({"url": decode_old.url})).await;
        assert_eq!(st, 400, "{v}");
        let (st, _) = add(&plain.url(), json!({"url": regular.url})).await;
        assert_eq!(st, 202);

        // The configured workers of a gateway are checked the same way.
        let cfg = GatewayConfig {
            pd: true,
            workers: vec![
                WorkerSpec::prefill(&decode_old.url, None),
                WorkerSpec::decode(&prefill.url),
            ],
            ..Default::default()
        };
        let e = gateway::start(cfg)
            .await
            .expect_err("mismatched types refused");
        assert!(e.to_string().contains("it is a decode server"), "{e}");
    })
    .await;
}

#[tokio::test]
async fn a_server_that_cannot_say_is_registered_as_given() {
    within(20, async {
        // No disaggregation_mode in its info (vLLM-like), an info endpoint that fails, and a
        // server that is not up yet: all registered as before the check existed.
        let silent = fake(|_, _, _| Reply::Json(StatusCode::OK, json!({"version": "x"}))).await;
        let broken = fake(|_, _, _| Reply::Text(StatusCode::INTERNAL_SERVER_ERROR, "oops")).await;
        let unknown = reporting(json!("encode"), "/server_info").await;
        let pd = gw(true, vec![], 0).await;
        for (url, t) in [
            (silent.url.clone(), "decode"),
            (broken.url.clone(), "prefill"),
            (unknown.url.clone(), "decode"),
            ("http://127.0.0.1:9".to_string(), "decode"),
        ] {
            let (st, v) = add(&pd.url(), json!({"url": url, "worker_type": t})).await;
            assert_eq!(st, 202, "{url}: {v}");
        }
        let (_, list) = get(&format!("{}/workers", pd.url())).await;
        assert_eq!(list["total"], 4);
    })
    .await;
}

/// A gateway is never its own worker, however its address is written, and requests that come
/// back to a gateway through another one end with 508 instead of going round.
mod loops {
    use super::*;

    #[tokio::test]
    async fn a_gateway_refuses_itself_as_a_worker_in_any_spelling() {
        within(20, async {
            let g = gw(false, vec![], 0).await;
            let port = g.addr().port();
            for url in [
                g.url(),
                format!("http://localhost:{port}"),
                format!("http://0x7f000001:{port}"),
                format!("http://0x7f.0.0.1:{port}"),
                format!("http://2130706433:{port}/"),
            ] {
                let (st, v) = add(&g.url(), json!({"url": url})).await;
                assert_eq!(st, 400, "{url}: {v}");
                let msg = v["message"].as_str().unwrap_or("");
                assert!(msg.contains("this gateway itself"), "{url}: {msg}");
            }
            assert_eq!(get(&format!("{}/workers", g.url())).await.1["total"], 0);

            // Listening on every interface, any local address with its port is itself.
            let all = gw_with(GatewayConfig {
                listen: "0.0.0.0:0".into(),
                admin_key: Some("k".into()),
                ..GatewayConfig::default()
            })
            .await;
            let url = format!("http://127.0.0.1:{}", all.addr().port());
            let r = client()
                .post(format!("{url}/workers"))
                .bearer_auth("k")
                .json(&json!({"url": url}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400);
            let v: Value = r.json().await.unwrap();
            assert!(
                v["message"].as_str().unwrap_or("").contains("itself"),
                "{v}"
            );
        })
        .await
    }

    #[tokio::test]
    async fn one_server_by_two_spellings_is_registered_once() {
        within(20, async {
            let b = reporting(json!("null"), "/server_info").await;
            let g = gw(false, vec![], 0).await;
            let port = port_of(&b.url).to_string();
            let (st, v) = add(&g.url(), json!({"url": b.url})).await;
            assert_eq!(st, 202, "{v}");
            for other in [
                format!("http://0x7f.0.0.1:{port}"),
                format!("http://0x7f000001:{port}"),
                format!("http://127.1:{port}"),
            ] {
                let (st, v) = add(&g.url(), json!({"url": other})).await;
                assert_eq!(st, 400, "{other}: {v}");
            }
            assert_eq!(get(&format!("{}/workers", g.url())).await.1["total"], 1);
        })
        .await
    }

    #[tokio::test]
    async fn a_loop_through_two_gateways_ends_in_508() {
        within(30, async {
            let a = gw(false, vec![], 0).await;
            let b = gw(false, vec![], 0).await;
            // b is a worker of a; a (which answers b's probe of its fleet info) one of b.
            let (st, v) = add(&a.url(), json!({"url": b.url()})).await;
            assert_eq!(st, 202, "{v}");
            let (st, v) = add(&b.url(), json!({"url": a.url()})).await;
            assert_eq!(st, 202, "a's fleet answers b's probe: registered: {v}");
            // The fleet's control fan-out ends.
            let (st, v) = post(&format!("{}/pause_generation", a.url()), &json!({})).await;
            assert_eq!(st, 502, "{v}");
            assert!(v.to_string().contains("508"), "{v}");
            let (st, v) = get(&format!("{}/is_paused", a.url())).await;
            assert_eq!((st, &v["is_paused"]), (200, &json!(false)), "{v}");
            // A generation request comes back to the gateway that sent it: 508, at once.
            let (st, v) = post(&format!("{}/generate", a.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 508, "{v}");
        })
        .await
    }

    /// A worker that answers 508 to a request straight from a client leads into a loop: it is
    /// removed, so the next requests go to the workers that serve (issue 49). Before, it stayed
    /// registered and every request routed to it looped again.
    #[tokio::test]
    async fn a_worker_that_leads_into_a_loop_is_removed_and_the_rest_serve() {
        within(30, async {
            let real = reporting(json!("null"), "/server_info").await;
            let round_robin = troupe_serving::RouterConfig {
                policy: troupe_serving::policy::PolicyKind::RoundRobin,
                ..Default::default()
            };
            let a = support::gw_routed(false, vec![], 0, round_robin).await;
            let b = gw(false, vec![], 0).await;
            for (gw, worker) in [
                (a.url(), real.url.clone()),
                (a.url(), b.url()),
                (b.url(), a.url()),
            ] {
                let (st, v) = add(&gw, json!({"url": worker})).await;
                assert_eq!(st, 202, "{worker} into {gw}: {v}");
            }
            let (url, body) = (format!("{}/generate", a.url()), json!({"text": "x"}));
            let generate = || post(&url, &body);
            // Round robin sends one of the first two requests to b, which leads back to a.
            let mut answers = Vec::new();
            for _ in 0..2 {
                answers.push(generate().await.0);
            }
            answers.sort_unstable();
            assert_eq!(answers, [200, 508]);
            let (_, v) = get(&format!("{}/workers", a.url())).await;
            let urls: Vec<&str> = v["workers"]
                .as_array()
                .map(|ws| ws.iter().filter_map(|w| w["url"].as_str()).collect())
                .unwrap_or_default();
            assert_eq!(urls, [real.url.as_str()], "{v}");
            for _ in 0..6 {
                let (st, v) = generate().await;
                assert_eq!(st, 200, "{v}");
            }
            // A 508 that a client's own via header causes removes nothing: the chain is theirs.
            let (_, before) = get(&format!("{}/workers", b.url())).await;
            let long: Vec<String> = (0..7).map(|i| format!("g{i}")).collect();
            let r = client()
                .post(format!("{}/generate", b.url()))
                .header("x-troupe-via", long.join(","))
                .json(&json!({"text": "x"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 508);
            let (_, after) = get(&format!("{}/workers", b.url())).await;
            assert_eq!(before["total"], 1, "{before}");
            assert_eq!(after["total"], 1, "{after}");
        })
        .await
    }
}

#[tokio::test]
async fn engines_reporting_impossible_gpu_counts_do_not_overflow_the_world_size() {
    within(20, async {
        let huge = || {
            fake(|path, _, _| {
                if path == "/server_info" {
                    Reply::Json(
                        StatusCode::OK,
                        json!({"tp_size": 4294967295u64, "pp_size": 1}),
                    )
                } else {
                    Reply::Json(StatusCode::OK, answer(1))
                }
            })
        };
        let (a, b) = (huge().await, huge().await);
        let g = gw(
            false,
            vec![WorkerSpec::regular(&a.url), WorkerSpec::regular(&b.url)],
            0,
        )
        .await;
        let (st, v) = get(&format!("{}/get_world_size", g.url())).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["world_size"], 2,
            "each counted as one GPU, not believed: {v}"
        );
    })
    .await
}
