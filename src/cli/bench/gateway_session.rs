//! `troupe bench gateway --chat --session-turns N`: recorded sessions of N short chat turns
//! through the in-process gateway, each turn sending the whole conversation so far (as agents
//! do), and the gateway's CPU per turn over the first 32 turns and the last 32 (a turn that
//! re-renders or re-matches the whole history costs more as the session grows), and a recorded
//! turn's CPU over an unrecorded one-message chat turn's, same run. `--session-repeat R`
//! sessions run one after another, and each turn's figure is its median over them: on a shared
//! machine one session's means swing by a third from run to run. Figures:
//! `gateway.session.{first32,last32}.cpu_us_per_turn`, `gateway.session.last_vs_first.cpu_ratio`,
//! `gateway.session.recorded_vs_chat.cpu_ratio`, `gateway.session.bytes_per_turn` (what the
//! session store on disk wrote per turn, with `--session-dir`).

use serde_json::{Value, json};

use super::gateway::GatewayBenchArgs;
use super::proc_cpu::spent;

/// Turns averaged at each end of the session.
const WINDOW: usize = 32;

/// Runs the session and adds its figures to `out`; `chat_us`: the unrecorded chat turn's CPU.
pub(super) async fn measure(
    c: &reqwest::Client,
    target: &str,
    args: &GatewayBenchArgs,
    prefix: &str,
    chat_us: Option<f64>,
    cpu: impl Fn() -> Result<Option<std::collections::HashMap<String, u64>>, String>,
    out: &mut Vec<(String, f64)>,
) -> Result<(), String> {
    let n = args.session_turns as usize;
    if n < 2 * WINDOW {
        return Err(format!(
            "--session-turns {n}: give at least {} turns (two windows of {WINDOW})",
            2 * WINDOW
        ));
    }
    let bytes0 = dir_bytes(args);
    let mut runs = Vec::with_capacity(args.session_repeat as usize);
    let mut bytes = None;
    for r in 0..args.session_repeat {
        let (per_turn, held) = session(c, target, args, &cpu).await?;
        if r == 0 {
            bytes = held.zip(bytes0).map(|(a, b)| a.saturating_sub(b));
        }
        if per_turn.len() == n {
            runs.push(per_turn);
        }
    }
    if runs.is_empty() {
        return Err("the gateway's threads' CPU could not be read".into());
    }
    // Each turn's median over the sessions.
    let per_turn: Vec<f64> = (0..n)
        .map(|i| {
            let mut v: Vec<f64> = runs.iter().map(|r| r[i]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
    let (first, last) = (mean(&per_turn[..WINDOW]), mean(&per_turn[n - WINDOW..]));
    out.push((format!("{prefix}.session.first32.cpu_us_per_turn"), first));
    out.push((format!("{prefix}.session.last32.cpu_us_per_turn"), last));
    if first > 0.0 {
        out.push((
            format!("{prefix}.session.last_vs_first.cpu_ratio"),
            last / first,
        ));
    }
    if let Some(chat) = chat_us.filter(|c| *c > 0.0) {
        out.push((
            format!("{prefix}.session.recorded_vs_chat.cpu_ratio"),
            mean(&per_turn) / chat,
        ));
    }
    if let Some(b) = bytes {
        out.push((
            format!("{prefix}.session.bytes_per_turn"),
            b as f64 / n as f64,
        ));
    }
    Ok(())
}

/// One session of `--session-turns` turns, finished: the gateway's CPU each turn took (µs;
/// none when its threads' times cannot be read), and the session directory's bytes before it
/// was finished (a finished session's file is removed once exported).
async fn session(
    c: &reqwest::Client,
    target: &str,
    args: &GatewayBenchArgs,
    cpu: &impl Fn() -> Result<Option<std::collections::HashMap<String, u64>>, String>,
) -> Result<(Vec<f64>, Option<u64>), String> {
    let n = args.session_turns as usize;
    let opened: Value = c
        .post(format!("{target}/sessions"))
        .json(&json!({}))
        .send()
        .await
        .map_err(|e| format!("POST /sessions: {e}"))?
        .json()
        .await
        .map_err(|e| format!("POST /sessions: {e}"))?;
    let key = opened["api_key"]
        .as_str()
        .ok_or_else(|| format!("POST /sessions answered {opened}"))?
        .to_string();
    let mut messages: Vec<Value> = Vec::new();
    let mut per_turn = Vec::with_capacity(n);
    for i in 0..n {
        messages.push(json!({"role": "user", "content": format!("turn {i}: benchmark prompt")}));
        let body =
            json!({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0});
        let before = cpu()?;
        let r = c
            .post(format!("{target}/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("turn {i}: {e}"))?;
        let after = cpu()?;
        let status = r.status();
        let v: Value = r.json().await.map_err(|e| format!("turn {i}: {e}"))?;
        if !status.is_success() {
            return Err(format!("turn {i}: {status}: {v}"));
        }
        if let (Some(a), Some(b)) = (before, after) {
            per_turn.push(spent(&a, &b) * 1e6);
        }
        messages.push(v["choices"][0]["message"].clone());
    }
    let held = dir_bytes(args);
    let _ = c
        .post(format!(
            "{target}/sessions/{}/finish",
            opened["session_id"].as_str().unwrap_or("")
        ))
        .bearer_auth(&key)
        .send()
        .await;
    Ok((per_turn, held))
}

/// Bytes the session directory holds (files written while the session is open).
fn dir_bytes(args: &GatewayBenchArgs) -> Option<u64> {
    let d = args.session_dir.as_ref()?;
    let mut total = 0;
    for e in std::fs::read_dir(d).ok()? {
        total += e.ok()?.metadata().ok()?.len();
    }
    Some(total)
}
