//! A gateway whose host is lost is started again on a surviving host.
//!
//! The gateway runs inside a host process; when that host dies (SIGKILL, OOM, a lost machine)
//! the watcher hears `HostLost` for it. The gateway is stateless but for its recorded agent
//! sessions, which it writes to its session directory as they happen
//! (`troupe_serving::gateway::agent::journal`): a new gateway started with the same settings
//! reads them back. So the re-placement starts one with the old one's settings on a surviving
//! host, with every server that serves now as its workers, at the old address when the new
//! host is on the same machine (clients keep their base URL), else on a fresh port of that
//! host's machine (the new URL is announced), and puts it in the deployment's
//! [`GatewaySlot`]. The session directory must be one the new host reads: for local hosts it
//! is on the one machine; across machines it must be shared storage.

use std::time::Duration;

use troupe_serving::actors::{GatewayActor, GetUrl};
use troupe_serving::control_plane::{Fleet, HeadState};
use troupe_serving::inference::WorkerType;

use super::addr::{host_port, machine};
use super::gateway_slot::GatewaySlot;
use super::instances::Instances;
use super::replace::Replacer;

/// Where the lost gateway's successor now answers.
pub(crate) struct NewGateway {
    /// The host it runs on.
    pub host: usize,
    /// Its URL (the old one when it could bind the old address).
    pub url: String,
}

/// The port of `url` (`http://host:port[/...]`), if it names one.
fn port_of(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// The machine of `url` (`http://host:port[/...]`).
fn machine_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    machine(rest.split('/').next().unwrap_or(rest))
}

/// Starts the lost gateway's successor on a surviving host (not `lost_host`) and puts it in
/// `slot`; the workers are the instances that serve now. Why not, when no host survives or
/// none would start it.
pub(crate) async fn replace_gateway(
    slot: &GatewaySlot,
    replacer: &Replacer,
    instances: &Instances,
    fleet: &Fleet,
    lost_host: usize,
) -> Result<NewGateway, String> {
    let old_url = slot.url();
    let old_machine = machine_of(&old_url);
    let mut hosts = replacer.live_hosts();
    hosts.retain(|h| h.index() != lost_host);
    // A host on the old gateway's machine first: it can take the old address.
    hosts.sort_by_key(|h| (machine(h.address()) != old_machine, h.index()));
    let Some(host) = hosts.into_iter().next() else {
        return Err("no host survives to run it".into());
    };
    let workers: Vec<_> = instances
        .live()
        .into_iter()
        .filter(|i| fleet.state(i.server_url()) == HeadState::Serving)
        .filter_map(|i| i.worker)
        .collect();
    let mut config = slot.config();
    config.pd = config.pd || workers.iter().any(|w| w.worker_type != WorkerType::Regular);
    config.workers = workers;
    let bind = if config.listen.is_empty() {
        machine(host.address())
    } else {
        machine(&config.listen)
    };
    let same_machine = machine(host.address()) == old_machine;
    let mut listens = Vec::new();
    if let (true, Some(p)) = (same_machine, port_of(&old_url)) {
        listens.push(host_port(&bind, p));
    }
    listens.push(host_port(&bind, 0));
    let mut why = String::new();
    for listen in listens {
        let args = troupe_serving::gateway::GatewayConfig {
            listen: listen.clone(),
            ..config.clone()
        };
        let started = match host.spawn::<GatewayActor>("gateway", &args).await {
            Ok(g) => g,
            Err(e) => {
                why = format!("on host {} at {listen}: {e}", host.index());
                continue;
            }
        };
        match started.call(GetUrl).await {
            Ok(url) => {
                // The next re-placement starts from what this one was started with, but binds
                // as configured.
                let next = troupe_serving::gateway::GatewayConfig {
                    listen: config.listen.clone(),
                    ..args
                };
                slot.swap(started, host.index(), url.clone(), next);
                return Ok(NewGateway {
                    host: host.index(),
                    url,
                });
            }
            Err(e) => {
                let _ = started.stop(Duration::from_secs(2)).await;
                why = format!("on host {}: {e}", host.index());
            }
        }
    }
    Err(format!("the new gateway did not start {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateway_url_names_its_machine_and_port() {
        assert_eq!(port_of("http://127.0.0.1:8123"), Some(8123));
        assert_eq!(port_of("http://[::1]:80/x"), Some(80));
        assert_eq!(port_of("http://host"), None);
        assert_eq!(machine_of("http://127.0.0.1:8123"), "127.0.0.1");
        assert_eq!(machine_of("http://[::1]:80"), "::1");
    }
}
