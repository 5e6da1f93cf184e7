//! The session store's own rules: which turn a request continues, idle sessions, limits.

use super::*;
use serde_json::json;

fn turn(msgs: &[Value], reply: &str, ids: &[u32]) -> Turn {
    Turn::new(
        "t".into(),
        msgs.to_vec(),
        json!({"role": "assistant", "content": reply}),
        ("P".to_string(), ids.to_vec()),
        ("O".into(), vec![9], vec![-0.5], vec![json!("1")]),
        json!({"type": "stop"}),
        json!({}),
        None,
    )
}

#[test]
fn a_turn_continues_the_turn_whose_messages_and_reply_it_starts_with() {
    let store = SessionStore::new(SessionLimits::default());
    let (id, key) = store.open(Some("task"), None).unwrap();
    assert_eq!(id, "task-0");
    assert_eq!(store.by_key(&key).as_deref(), Some("task-0"));
    let u1 = json!({"role": "user", "content": "hi"});
    store
        .record(&id, turn(std::slice::from_ref(&u1), "yo", &[1, 2]))
        .unwrap();
    let a1 = json!({"role": "assistant", "content": "yo", "refusal": null});
    let u2 = json!({"role": "user", "content": "more"});
    let b = store
        .base(&id, &vec![u1.clone(), a1.clone(), u2.clone()].into())
        .expect("continues");
    assert_eq!(
        (b.index, b.covered, b.ids.clone(), b.text.as_str()),
        (0, 2, vec![1, 2, 9], "PO")
    );
    let edited = json!({"role": "assistant", "content": "yo!"});
    assert!(
        store
            .base(&id, &vec![u1.clone(), edited, u2].into())
            .is_none(),
        "an edited history branches"
    );
    assert!(store.base(&id, &vec![u1].into()).is_none());
}

#[test]
fn idle_sessions_go_while_others_record() {
    let store = SessionStore::new(SessionLimits {
        idle_ttl: Duration::from_millis(30),
        ..SessionLimits::default()
    });
    let (idle, key) = store.open(None, None).unwrap();
    let (busy, _) = store.open(None, None).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let u = json!({"role": "user", "content": "x"});
    store
        .record(&busy, turn(std::slice::from_ref(&u), "a", &[1]))
        .unwrap();
    assert!(
        !store.contains(&idle) && store.by_key(&key).is_none(),
        "the idle one is gone"
    );
    assert!(store.contains(&busy));
}

#[test]
fn limits_hold() {
    let store = SessionStore::new(SessionLimits {
        max_sessions: 1,
        max_session_tokens: 4,
        idle_ttl: Duration::from_secs(3600),
    });
    let (id, key) = store.open(None, None).unwrap();
    assert!(matches!(store.open(None, None), Err(AgentError::Full(_))));
    let u = json!({"role": "user", "content": "x"});
    assert!(
        store
            .record(&id, turn(std::slice::from_ref(&u), "a", &[1, 2, 3, 4]))
            .is_err(),
        "5 tokens"
    );
    store.record(&id, turn(&[u], "a", &[1, 2])).unwrap();
    assert!(store.set_reward(&id, None, f64::NAN).is_err());
    store.set_reward(&id, Some("t"), 1.0).unwrap();
    assert!(store.set_reward(&id, Some("nope"), 1.0).is_err());
    let s = store.take(&id).unwrap();
    assert_eq!(s.turns[0].reward, Some(1.0));
    assert!(store.by_key(&key).is_none() && store.is_empty());
    store.open(None, Some("mine")).unwrap();
    assert!(matches!(
        store.open(None, Some("mine")),
        Err(AgentError::Conflict(_) | AgentError::Full(_))
    ));
}

#[test]
fn a_history_sent_again_byte_for_byte_is_known_without_reading_it() {
    let store = SessionStore::new(SessionLimits::default());
    let (id, _) = store.open(None, None).unwrap();
    let u1 = json!({"role": "user", "content": "hi"});
    store
        .record(&id, turn(std::slice::from_ref(&u1), "yo", &[1, 2]))
        .unwrap();
    let sent = br#"{"role":"user","content":"hi"}"#;
    // Kept only for the session's latest turn, by its id.
    store.keep_sent(&id, "not-it", bytes::Bytes::copy_from_slice(sent));
    assert!(store.known(&id, |_| Some(&sent[..])).is_none());
    store.keep_sent(&id, "t", bytes::Bytes::copy_from_slice(sent));
    let k = store
        .known(&id, |m| (m == 1).then_some(&sent[..]))
        .expect("the same bytes");
    assert_eq!((k.turn, k.messages.to_vec()), (0, vec![u1.clone()]));
    assert!(
        store
            .known(&id, |_| Some(&br#"{"role": "user", "content": "hi"}"#[..]))
            .is_none(),
        "written differently: read message by message"
    );
    assert!(store.known(&id, |_| None).is_none(), "too few messages");
    // A newer turn makes the kept bytes stale.
    store.record(&id, turn(&[u1], "again", &[3])).unwrap();
    assert!(store.known(&id, |_| Some(&sent[..])).is_none());
}

#[test]
fn a_continued_turn_shares_its_history_with_the_turn_it_continues() {
    let store = SessionStore::new(SessionLimits::default());
    let (id, _) = store.open(None, None).unwrap();
    let u1 = json!({"role": "user", "content": "hi"});
    store
        .record(&id, turn(std::slice::from_ref(&u1), "yo", &[1, 2]))
        .unwrap();
    let msgs = vec![
        u1,
        json!({"role": "assistant", "content": "yo"}),
        json!("more"),
    ];
    let mut t = turn(&msgs, "ok", &[1, 2, 9, 4]);
    t.prompt_text = "POnew".to_string().into();
    t.parent = Some(0);
    store.record(&id, t).unwrap();
    let g = store.inner.lock();
    let [a, b] = &g.sessions[&id].turns[..] else {
        panic!("two turns")
    };
    assert!(b.prompt_ids.starts_with_shared(&a.prompt_ids));
    assert!(b.prompt_text.starts_with_shared(&a.prompt_text));
    assert!(b.messages.starts_with_shared(&a.messages));
    // What they read as and write out is unchanged.
    assert_eq!(b.prompt_ids.to_vec(), vec![1, 2, 9, 4]);
    assert_eq!(serde_json::to_string(&b.prompt_text).unwrap(), "\"POnew\"");
    assert_eq!(b.messages.to_vec(), msgs);
}
