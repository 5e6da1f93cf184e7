//! `troupe bench gateway --chat --session-turns N`: one recorded session of N short chat turns
//! through the in-process gateway, each turn sending the whole conversation so far (as agents
//! do), and the gateway's CPU per turn over the first 32 turns and the last 32 (a turn that
//! re-renders or re-matches the whole history costs more as the session grows), and a recorded
//! turn's CPU over an unrecorded one-message chat turn's, same run. Figures:
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
    let bytes0 = dir_bytes(args);
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
    let bytes = dir_bytes(args)
        .zip(bytes0)
        .map(|(a, b)| a.saturating_sub(b));
    let _ = c
        .post(format!(
            "{target}/sessions/{}/finish",
            opened["session_id"].as_str().unwrap_or("")
        ))
        .bearer_auth(&key)
        .send()
        .await;
    if per_turn.len() < n || n < 2 * WINDOW {
        return Err(format!(
            "--session-turns {n}: give at least {} turns (two windows of {WINDOW})",
            2 * WINDOW
        ));
    }
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

/// Bytes the session directory holds (files written while the session is open).
fn dir_bytes(args: &GatewayBenchArgs) -> Option<u64> {
    let d = args.session_dir.as_ref()?;
    let mut total = 0;
    for e in std::fs::read_dir(d).ok()? {
        total += e.ok()?.metadata().ok()?.len();
    }
    Some(total)
}
