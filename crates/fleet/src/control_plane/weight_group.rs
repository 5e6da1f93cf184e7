//! The broadcast group of a weight sync and what goes over it: building the group (every
//! engine joins rank 0, proving the group's secret), sending one bucket to every engine at
//! once (staged on the engines that stage, `troupe_wire::staging`), vLLM's start and finish
//! phases, and leaving the group.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;

use troupe_weights::bucket::Bucket;
use troupe_weights::plan::{EngineGpus, WeightSyncPlan};
use troupe_weights::tcp::{SharedTensorRef, WeightSender};
use troupe_wire::WeightVersion;
use troupe_wire::sglang::{InitWeightsUpdateGroup, UpdateWeightsFromDistributed};

use super::catch_up::ControlHandle;
use crate::engines::{Engine, EngineDialect};

/// Rank 0's end of a built group: who joined, under which fleet generation.
pub(super) struct Group {
    pub(super) sender: WeightSender,
    pub(super) members: Vec<String>,
    pub(super) generation: u64,
}

/// How one bucket is sent.
pub(super) struct BucketSend<'a> {
    /// The group's name on every engine.
    pub(super) group_name: &'a str,
    /// The version being sent (the staging key on engines that stage).
    pub(super) version: &'a WeightVersion,
    /// Flush engines' prefix caches with it.
    pub(super) flush: bool,
    /// Engines (by URL) that stage it.
    pub(super) staged: &'a HashSet<String>,
}

/// Sends one bucket to every engine of `group`: each is told what comes, and rank 0 sends.
/// An engine that refuses the bucket (an unknown name, a wrong shape) never reads it, so the
/// broadcast would wait for it forever: a refusal ends the send at once (the group is rebuilt
/// next time).
pub(super) async fn send_bucket(
    group: &mut Group,
    control: &dyn ControlHandle,
    engines: &[Engine],
    b: &Bucket,
    bytes: &HashMap<String, Bytes>,
    how: &BucketSend<'_>,
) -> Result<(), String> {
    let plain = UpdateWeightsFromDistributed {
        names: b.names().into_iter().map(String::from).collect(),
        dtypes: b.dtypes().into_iter().map(String::from).collect(),
        shapes: b.shapes(),
        group_name: how.group_name.to_string(),
        flush_cache: how.flush,
        // An engine that applies buckets as they arrive is labelled once, by the finish
        // phase after the last bucket: a bucket never names a version its engine does not
        // wholly hold.
        weight_version: None,
        packed: false,
        stage: false,
    };
    let staged = UpdateWeightsFromDistributed {
        weight_version: Some(how.version.as_str().to_string()),
        stage: true,
        ..plain.clone()
    };
    let mut refs = Vec::with_capacity(b.tensors.len());
    for t in &b.tensors {
        let data = bytes
            .get(&t.name)
            .ok_or_else(|| format!("internal: no bytes for {}", t.name))?;
        refs.push(SharedTensorRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: data,
        });
    }
    let http = futures::future::join_all(engines.iter().map(|e| {
        let req = if how.staged.contains(&e.url) {
            &staged
        } else {
            &plain
        };
        async move {
            control
                .client()
                .update_weights(e, req)
                .await
                .map_err(|err| format!("{}: {err}", e.url))
        }
    }));
    let send = group.sender.send_bucket_shared(&refs);
    tokio::pin!(send);
    tokio::pin!(http);
    let mut sent = None;
    let answers = loop {
        tokio::select! {
            answers = &mut http => break answers,
            r = &mut send, if sent.is_none() => sent = Some(r),
        }
    };
    let errs: Vec<String> = answers.into_iter().filter_map(Result::err).collect();
    if !errs.is_empty() {
        return Err(errs.join("; "));
    }
    let sent = match sent {
        Some(r) => r,
        None => send.await,
    };
    sent.map_err(|e| format!("broadcast failed: {e}"))
}

/// Builds a group of `engines` named `name` with rank 0 bound on `master_host`; engines prove
/// its secret to join (the init call is admin-keyed; the port and name are not secret).
pub(super) async fn build(
    control: &dyn ControlHandle,
    engines: &[Engine],
    name: &str,
    master_host: &str,
    join_timeout: std::time::Duration,
) -> Result<WeightSender, String> {
    let plan = WeightSyncPlan::new(
        name,
        &engines
            .iter()
            .map(|e| EngineGpus {
                engine: e.url.clone(),
                gpus: e.gpus,
            })
            .collect::<Vec<_>>(),
        1,
    )
    .map_err(|e| e.to_string())?;
    let world = plan.world_size();
    let mut sender = WeightSender::bind(&format!("{master_host}:0"), world as usize, name)
        .await
        .map_err(|e| format!("cannot open the broadcast master: {e}"))?;
    let port = sender.local_addr().map_err(|e| e.to_string())?.port();
    let secret = sender.secret();
    let joins = engines.iter().enumerate().map(|(i, e)| {
        let req = InitWeightsUpdateGroup {
            master_address: master_host.to_string(),
            master_port: port,
            rank_offset: plan.rank_offset(i).unwrap_or(0),
            world_size: world,
            group_name: name.to_string(),
            backend: Some("tcp".into()),
            group_secret: Some(secret.clone()),
        };
        async move {
            control
                .client()
                .init_weight_group(e, &req)
                .await
                .map_err(|err| format!("{}: {err}", e.url))
        }
    });
    // Once every engine has answered and one refused, nobody will connect for it: the
    // failure is reported then, not after the whole join timeout.
    let (accepted, joined) = {
        let accept = sender.accept_all(join_timeout);
        let joins = futures::future::join_all(joins);
        tokio::pin!(accept, joins);
        tokio::select! {
            joined = &mut joins => {
                if joined.iter().any(Result::is_err) {
                    (None, joined)
                } else {
                    (Some(accept.await), joined)
                }
            }
            accepted = &mut accept => (Some(accepted), joins.await),
        }
    };
    let errs: Vec<String> = joined.into_iter().filter_map(Result::err).collect();
    if !errs.is_empty() {
        return Err(format!(
            "engines failed to join the weight group: {}",
            errs.join("; ")
        ));
    }
    if let Some(accepted) = accepted {
        accepted.map_err(|e| format!("engines did not connect to the broadcast master: {e}"))?;
    }
    Ok(sender)
}

/// Has every engine of `control` that is one of `members` leave group `name`, all at once
/// (best effort).
pub(super) async fn leave(control: &dyn ControlHandle, members: &[String], name: &str) {
    let members: HashSet<&str> = members.iter().map(String::as_str).collect();
    let all = control.engines();
    futures::future::join_all(
        all.iter()
            .filter(|e| members.contains(e.url.as_str()))
            .map(|e| control.client().destroy_weight_group(e, name)),
    )
    .await;
}

/// The phases around the buckets that only vLLM's dialect has (a no-op for SGLang engines).
#[derive(Clone, Copy)]
pub(super) enum Phase<'a> {
    Start,
    /// Closes the transfer at this version; engines in the set staged theirs, so they are
    /// only closed (their commit names the version) and SGLang ones among them are not called.
    Finish(&'a WeightVersion, &'a HashSet<String>),
}

/// Runs `p` on every engine at once; every failure named.
pub(super) async fn phase(
    control: &dyn ControlHandle,
    engines: &[Engine],
    p: Phase<'_>,
) -> Result<(), String> {
    let calls = engines.iter().map(|e| async move {
        let c = control.client();
        let r = match p {
            Phase::Start => c.start_weight_update(e).await,
            Phase::Finish(_, staged)
                if staged.contains(&e.url) && e.dialect == EngineDialect::Sglang =>
            {
                return Ok(());
            }
            Phase::Finish(_, staged) if staged.contains(&e.url) => {
                c.finish_weight_update(e, None).await
            }
            Phase::Finish(v, _) => c.finish_weight_update(e, Some(v)).await,
        };
        r.map(|_| ()).map_err(|err| format!("{}: {err}", e.url))
    });
    let errs: Vec<String> = futures::future::join_all(calls)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}
