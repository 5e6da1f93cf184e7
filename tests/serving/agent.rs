//! The gateway's agent layer in front of a real reference engine: chat from token ids, recorded
//! sessions whose trajectories hold exactly the engine's tokens, tool calls, versions across a
//! weight update, AReaL's session routes, and bad requests answered in each API's error shape.

use crate::common;

use common::{client, engine, engine_args, post, within};
use serde_json::{Value, json};
use troupe_agent::{AgentSpec, TokenizerSource};
use troupe_engine::{EngineArgs, EngineHandle, hf_tokenizer};
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};

/// The reference model's agent layer (tokenizer built in, its tool-call parser), named `tiny`;
/// the fixture of every agent-layer test file here.
pub(crate) fn spec() -> AgentSpec {
    let mut s = AgentSpec::new(
        "tiny",
        TokenizerSource::Files {
            tokenizer_json: hf_tokenizer::tokenizer_json(),
            tokenizer_config_json: hf_tokenizer::tokenizer_config_json(),
        },
    );
    s.tool_call_parser = "reference".into();
    s
}

/// A reference engine (seed 3) behind a gateway with agent layer `spec` and admin key `admin`.
pub(crate) async fn setup(spec: AgentSpec, admin: Option<&str>) -> (EngineHandle, GatewayHandle) {
    let e = engine(EngineArgs {
        random_seed: 3,
        ..engine_args()
    })
    .await;
    let g = gateway::start(GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: vec![WorkerSpec::regular(e.url())],
        admin_key: admin.map(str::to_string),
        agent: Some(spec),
        ..Default::default()
    })
    .await
    .expect("gateway");
    (e, g)
}

/// Two reference engines behind a `sticky_least_loaded` gateway with the agent layer: where
/// each session's turns land shows in the engines' token counts.
async fn two_engines_sticky() -> (EngineHandle, EngineHandle, GatewayHandle) {
    let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
    let g = gateway::start(GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: vec![WorkerSpec::regular(a.url()), WorkerSpec::regular(b.url())],
        router: troupe_serving::RouterConfig {
            policy: troupe_serving::policy::PolicyKind::StickyLeastLoaded,
            ..Default::default()
        },
        agent: Some(spec()),
        ..Default::default()
    })
    .await
    .expect("gateway");
    (a, b, g)
}

/// POSTs `body` with bearer `key`: (status, JSON body or null).
pub(crate) async fn call(url: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut r = client().post(url).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("sent");
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_records_the_engines_exact_tokens_over_turns_and_a_weight_update() {
    within(90, async {
        let (e, g) = setup(spec(), None).await;
        let base = g.url();
        let (st, s) = call(&format!("{base}/sessions"), None, &json!({})).await;
        assert_eq!(st, 200, "{s}");
        let (sid, key) = (s["session_id"].as_str().unwrap(), s["api_key"].as_str().unwrap());
        let tools = json!([{"type": "function", "function": {"name": "calculator",
                            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}}}}]);
        let chat = format!("{base}/v1/chat/completions");
        let mut messages = vec![json!({"role": "user", "content": "What is 2+3?"})];
        // Turn 1: the request forces the calculator; the model writes the call's argument.
        let (st, a1) = call(&chat, Some(key), &json!({"model": "tiny", "messages": messages,
            "tools": tools, "tool_choice": {"type": "function", "function": {"name": "calculator"}},
            "max_tokens": 6, "temperature": 0})).await;
        assert_eq!(st, 200, "{a1}");
        assert_eq!(a1["choices"][0]["finish_reason"], "tool_calls", "{a1}");
        let call1 = &a1["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call1["function"]["name"], "calculator");
        messages.push(a1["choices"][0]["message"].clone());
        messages.push(json!({"role": "tool", "tool_call_id": call1["id"], "content": "5"}));
        // A weight update between turns: later tokens carry the new version.
        let (st, v) = post(&format!("{}/update_weight_version", e.url()), &json!({"new_version": "v2"})).await;
        assert_eq!(st, 200, "{v}");
        // Turn 2 and 3: plain answers continuing the conversation, as the SDK sends it back.
        for _ in 0..2 {
            let (st, a) = call(&chat, Some(key), &json!({"model": "tiny", "messages": messages,
                "tools": tools, "tool_choice": "none", "max_tokens": 5, "temperature": 0})).await;
            assert_eq!(st, 200, "{a}");
            messages.push(a["choices"][0]["message"].clone());
            messages.push(json!({"role": "user", "content": "and?"}));
        }
        let (st, r) = call(&format!("{base}/sessions/{sid}/reward"), Some(key), &json!({"reward": 0.5})).await;
        assert_eq!(st, 200, "{r}");
        let (st, t) = call(&format!("{base}/sessions/{sid}/finish"), Some(key), &json!({})).await;
        assert_eq!(st, 200, "{t}");
        let turns = t["turns"].as_array().expect("turns");
        assert_eq!(turns.len(), 3, "{t}");
        assert_eq!(t["reward"], 0.5);
        for (i, turn) in turns.iter().enumerate() {
            let (p, o) = (ids(&turn["prompt_ids"]), ids(&turn["output_ids"]));
            // The output is what the engine makes for exactly this prompt (greedy, replayed).
            let (st, again) = post(&format!("{}/generate", e.url()), &json!({"input_ids": p,
                "sampling_params": {"max_new_tokens": o.len(), "temperature": 0, "stop_token_ids": [257]}})).await;
            assert_eq!(st, 200, "{again}");
            assert_eq!(ids(&again["output_ids"]), o, "turn {i}'s output is the engine's");
            let mask = ids(&turn["loss_mask"]);
            assert_eq!(mask.len(), p.len() + o.len());
            assert!(mask[..p.len()].iter().all(|m| *m == 0) && mask[p.len()..].iter().all(|m| *m == 1));
            assert_eq!(turn["output_logprobs"].as_array().map(Vec::len), Some(o.len()));
            let want = if i == 0 { "default" } else { "v2" };
            assert!(turn["weight_versions"].as_array().unwrap().iter().all(|v| v == want), "{turn}");
            if i > 0 {
                // Token in, token out: this prompt starts with the last turn's prompt and output.
                let prev = &turns[i - 1];
                let mut head = ids(&prev["prompt_ids"]);
                head.extend(ids(&prev["output_ids"]));
                assert_eq!(p[..head.len()], head[..], "turn {i} extends turn {}", i - 1);
                assert_eq!(turn["parent"], i - 1);
            }
        }
        // The forced call's prefix is prompt, not model output.
        assert_eq!(ids(&turns[0]["prompt_ids"]).last(), Some(&259), "<|tool_call|> ends turn 1's prompt");
        let (st, _) = call(&format!("{base}/sessions/{sid}/finish"), Some(key), &json!({})).await;
        assert_eq!(st, 404, "finished once");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn areals_session_routes_record_and_export_its_interactions() {
    within(60, async {
        let (e, g) = setup(spec(), Some("adm")).await;
        let base = g.url();
        let (st, v) = call(
            &format!("{base}/rl/start_session"),
            Some("adm"),
            &json!({"task_id": "t"}),
        )
        .await;
        assert_eq!(
            (st, v["detail"].is_string()),
            (429, true),
            "no capacity granted yet: {v}"
        );
        let (st, v) = call(
            &format!("{base}/rl/start_session"),
            None,
            &json!({"task_id": "t"}),
        )
        .await;
        assert_eq!(st, 401, "the admin key opens sessions: {v}");
        let (st, v) = call(&format!("{base}/grant_capacity"), Some("adm"), &json!({})).await;
        assert_eq!((st, v["capacity"].clone()), (200, json!(1)));
        let (st, s) = call(
            &format!("{base}/rl/start_session"),
            Some("adm"),
            &json!({"task_id": "t"}),
        )
        .await;
        assert_eq!(st, 200, "{s}");
        assert_eq!(s["session_id"], "t-0");
        let key = s["api_key"].as_str().unwrap();
        // AReaL's agents use base_url without /v1.
        let (st, a) = call(
            &format!("{base}/chat/completions"),
            Some(key),
            &json!({"model": "tiny",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        )
        .await;
        assert_eq!(st, 200, "{a}");
        let id = a["id"].as_str().unwrap();
        let (st, v) = call(
            &format!("{base}/rl/set_reward"),
            Some(key),
            &json!({"interaction_id": id, "reward": 1.0}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let (st, v) = call(
            &format!("{base}/rl/set_reward"),
            Some(key),
            &json!({"interaction_id": "nope", "reward": 1.0}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        let (st, v) = call(&format!("{base}/rl/end_session"), Some(key), &json!({})).await;
        assert_eq!((st, v["interaction_count"].clone()), (200, json!(1)), "{v}");
        let (st, x) = call(
            &format!("{base}/export_trajectories"),
            Some("adm"),
            &json!({"session_id": "t-0", "discount": 1.0, "style": "individual"}),
        )
        .await;
        assert_eq!(st, 200, "{x}");
        let it = &x["interactions"][id];
        assert_eq!(it["reward"], 1.0);
        let t = &it["tensor_dict"];
        let n = a["usage"]["total_tokens"].as_u64().unwrap() as usize;
        assert_eq!(t["input_ids"]["shape"], json!([1, n]));
        assert_eq!(t["input_ids"]["dtype"], "torch.int64");
        use base64::Engine as _;
        let mask = base64::engine::general_purpose::STANDARD
            .decode(t["loss_mask"]["data"].as_str().unwrap())
            .unwrap();
        let ones = mask.chunks(8).filter(|c| c[0] == 1).count();
        assert_eq!(
            ones,
            a["usage"]["completion_tokens"].as_u64().unwrap() as usize,
            "the mask covers the output"
        );
        let (st, _) = call(
            &format!("{base}/export_trajectories"),
            Some("adm"),
            &json!({"session_id": "t-0"}),
        )
        .await;
        assert_eq!(st, 404, "exported once");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_agent_requests_get_their_apis_error_shape_and_change_nothing() {
    within(60, async {
        let mut small = spec();
        small.max_session_tokens = 60;
        let (e, g) = setup(small, None).await;
        let base = g.url();
        let chat = format!("{base}/v1/chat/completions");
        let hi = json!([{"role": "user", "content": "hi"}]);
        for (body, status, what) in [
            (json!({"model": "big", "messages": hi}), 404, "does not exist"),
            (json!({"messages": hi}), 400, "model is required"),
            (json!({"model": "tiny", "messages": []}), 400, "non-empty"),
            (json!({"model": "tiny", "messages": hi, "n": 2}), 400, "n must be 1"),
            (json!({"model": "tiny", "messages": hi, "tool_choice": {"type": "function", "function": {"name": "x"}}}), 400, "not among"),
            (json!({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "only text"),
        ] {
            let (st, v) = call(&chat, None, &body).await;
            assert_eq!(st, status, "{v}");
            let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("OpenAI's shape: {v}"));
            assert!(msg.contains(what), "{msg}");
        }
        let msgs = format!("{base}/v1/messages");
        for (body, status, kind) in [
            (json!({"model": "tiny", "messages": hi}), 400, "invalid_request_error"),
            (json!({"model": "nope", "max_tokens": 3, "messages": hi}), 404, "not_found_error"),
            (json!({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image"}]}]}), 400, "invalid_request_error"),
        ] {
            let (st, v) = call(&msgs, None, &body).await;
            assert_eq!((st, v["type"].clone(), v["error"]["type"].clone()), (status, json!("error"), json!(kind)), "{v}");
        }
        let (st, v) = call(&format!("{base}/v1/messages/count_tokens"), None, &json!({"model": "tiny", "messages": hi})).await;
        assert_eq!((st, v["input_tokens"].clone()), (200, json!(26)), "{v}");
        // A session past its token cap: the turn is refused and nothing is recorded.
        let (_, s) = call(&format!("{base}/sessions"), None, &json!({})).await;
        let (sid, key) = (s["session_id"].as_str().unwrap(), s["api_key"].as_str().unwrap());
        let (st, v) = call(&chat, Some(key), &json!({"model": "tiny", "messages": hi, "max_tokens": 3})).await;
        assert_eq!(st, 200, "{v}");
        let long = json!([{"role": "user", "content": "x".repeat(80)}]);
        let (st, v) = call(&chat, Some(key), &json!({"model": "tiny", "messages": long, "max_tokens": 3})).await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("max_session_tokens"), "{v}");
        let (st, v) = call(&format!("{base}/sessions/{sid}/reward"), Some(key), &json!({"reward": "high"})).await;
        assert_eq!((st, v["detail"].is_string()), (400, true), "{v}");
        let (st, v) = call(&format!("{base}/sessions/nope/finish"), None, &json!({})).await;
        assert_eq!((st, v["detail"].is_string()), (404, true), "{v}");
        let (st, t) = call(&format!("{base}/sessions/{sid}/finish"), Some(key), &json!({})).await;
        assert_eq!(st, 200);
        assert_eq!(t["turns"].as_array().map(Vec::len), Some(1), "the refused turn left no trace: {t}");
        let (st, v) = call(&format!("{base}/rl/end_session"), Some("not-a-key"), &json!({})).await;
        assert_eq!(st, 401, "{v}");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sessions_bearer_key_is_its_routing_key_on_every_data_route() {
    within(60, async {
        let (a, b, g) = two_engines_sticky().await;
        let base = g.url();
        let mut homes = Vec::new();
        for _ in 0..2 {
            let (_, s) = call(&format!("{base}/sessions"), None, &json!({})).await;
            let key = s["api_key"].as_str().unwrap().to_string();
            let mut home = None;
            for _ in 0..3 {
                let before = [
                    common::generated_tokens(&a.url()).await,
                    common::generated_tokens(&b.url()).await,
                ];
                // Plain SGLang /generate, no session header: the bearer key names the session.
                let (st, v) = call(
                    &format!("{base}/generate"),
                    Some(&key),
                    &json!({"text": "hi",
                    "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}}),
                )
                .await;
                assert_eq!(st, 200, "{v}");
                let after = [
                    common::generated_tokens(&a.url()).await,
                    common::generated_tokens(&b.url()).await,
                ];
                let on = (0..2).find(|i| after[*i] > before[*i]);
                assert!(
                    home.is_none() || home == on,
                    "a session's requests stay on one engine"
                );
                home = on;
            }
            homes.push(home);
        }
        assert_ne!(
            homes[0], homes[1],
            "the second session goes to the engine with none"
        );
        g.shutdown().await.expect("gateway stops");
        a.shutdown().await.expect("engine stops");
        b.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrecorded_chats_session_header_routes_its_turns_through_the_agent_layer() {
    within(60, async {
        let (a, b, g) = two_engines_sticky().await;
        let base = g.url();
        let mut homes = Vec::new();
        for session in ["s-one", "s-two"] {
            let mut home = None;
            for turn in 0..3 {
                let before = [
                    common::generated_tokens(&a.url()).await,
                    common::generated_tokens(&b.url()).await,
                ];
                // An OpenAI chat the agent layer renders, not a recorded session: the
                // client's X-Session-ID still routes it, as it does without the layer.
                let r = client()
                    .post(format!("{base}/v1/chat/completions"))
                    .header("X-Session-ID", session)
                    .json(&json!({"model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "user", "content": format!("turn {turn}")}]}))
                    .send()
                    .await
                    .expect("sent");
                assert_eq!(r.status().as_u16(), 200);
                let after = [
                    common::generated_tokens(&a.url()).await,
                    common::generated_tokens(&b.url()).await,
                ];
                let on = (0..2).find(|i| after[*i] > before[*i]);
                assert!(home.is_none() || home == on, "{session} turn {turn} moved");
                home = on;
            }
            homes.push(home);
        }
        assert_ne!(
            homes[0], homes[1],
            "a new session goes to the engine with none"
        );
        g.shutdown().await.expect("gateway stops");
        a.shutdown().await.expect("engine stops");
        b.shutdown().await.expect("engine stops");
    })
    .await
}
