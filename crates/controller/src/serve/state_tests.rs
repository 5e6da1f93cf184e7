//! Tests of the state file and of reattaching from it (`state.rs`).

use troupe_serving::actors::{ProxyActor, ProxyArgs};

use super::*;
use crate::serve::deployment::tests::deployment;
use crate::serve::instances::tests::entry;
use crate::serve::instances::{InstanceState, InstanceView};

#[tokio::test]
async fn the_state_file_is_the_table_and_reattach_rebuilds_it() {
    let cluster = Cluster::in_process(1, 2).await.unwrap();
    let host = cluster.host(0);
    let d = deployment(&cluster).await;
    let old_url = d.instances.all()[0].server_url().to_string();
    let st = d.state(&cluster);
    let json = serde_json::to_value(&st).unwrap();
    assert_eq!(json["format"], 3);
    assert!(json.get("servers").is_none(), "no record beside the table");
    assert_eq!(json["instances"][0]["life"], "starting");
    assert_eq!(json["instances"][0]["nodes"][0]["name"], "regular-c0g0i0n0");
    // Its server actor is not running: reattach says which.
    let Err(e) = Deployment::reattach(
        &cluster,
        &st,
        &ForkOptions {
            server_restarts: 0,
            ..ForkOptions::default()
        },
    )
    .await
    else {
        panic!("reattached to a server that is not running");
    };
    let e = e.to_string();
    assert!(
        e.contains("server regular-c0g0i0n0") && e.contains("no longer running"),
        "{e}"
    );

    // Re-placed by a successor whose actors run (a proxy stands in for its server).
    let stand_in = host
        .spawn::<ProxyActor>(
            "proxy",
            &ProxyArgs {
                listen: "127.0.0.1:0".into(),
                backends: vec!["http://127.0.0.1:1".into()],
                ..ProxyArgs::default()
            },
        )
        .await
        .unwrap();
    let mut successor = entry(host, (0, 0, 0, 0), 1);
    successor.info.url = "http://127.0.0.1:29999".into();
    successor.actor = host.attach(stand_in.id().to_string());
    let mut successor = Instance::starting(successor, Vec::new());
    let worker = super::super::routing::worker_spec(&successor.head.info, "http://p2".into());
    successor.routed_through(stand_in, worker);
    d.instances.replace(&old_url, successor);

    let path = std::env::temp_dir().join(format!("troupe-state-{}.json", std::process::id()));
    d.state(&cluster).save(&path).unwrap();
    let st = ServeState::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let r = Deployment::reattach(
        &cluster,
        &st,
        &ForkOptions {
            server_restarts: 0,
            ..ForkOptions::default()
        },
    )
    .await
    .unwrap();
    let rows: Vec<(String, InstanceState, Option<String>)> = r
        .instances()
        .into_iter()
        .map(|v: InstanceView| (v.server_url, v.state, v.replaced_by))
        .collect();
    let new_url = "http://127.0.0.1:29999".to_string();
    assert_eq!(
        rows,
        vec![
            (old_url, InstanceState::Replaced, Some(new_url.clone())),
            (new_url.clone(), InstanceState::Routed, None),
        ]
    );
    let servers = r.servers();
    assert_eq!(servers.len(), 1);
    assert_eq!(
        (servers[0].info.url.as_str(), servers[0].spec.gpus.clone()),
        (new_url.as_str(), vec![1])
    );
    assert_eq!(r.inf_addrs, vec![servers[0].info.addr.clone()]);
    assert_eq!(r.claims.len(), 1, "the live server's port is claimed again");
    r.teardown().await;
    drop(d);
    cluster.shutdown().await;
}
