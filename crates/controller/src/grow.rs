//! Hosts added to a running cluster, and given back: what lets the elastic fleet outgrow the
//! first allocation (on Slurm: one more job per growth, cancelled when its servers are gone).
//!
//! The cluster's first hosts are fixed ([`crate::cluster::Cluster::hosts`]); hosts added
//! later live here, numbered after them (a launcher's [`HostLauncher::grow`] gives each the
//! next free index, and its id `host-<index>`), connected and watched like the first ones (the
//! same rendezvous, registration and event stream), so a host lost among them is reported and
//! re-placed as any other. Each growth is one unit ([`Grown::id`], a Slurm job id) given back
//! whole: its hosts are marked released first, so their streams ending is no "host lost".

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use troupe_actors::tls::ClientTls;
use troupe_scheduler::{HostLauncher, LaunchError, LaunchRequest};

use troupe_actors::CallError;

use crate::conn::{CallTransport, HostConn};
use crate::handle::HostHandle;
use crate::membership::{EventSinks, watch_host};

/// Why hosts could not be added or given back.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GrowError {
    /// The launcher cannot grow, refused, or failed (its words), or the cluster is closing.
    #[error("{0}")]
    Launch(String),
    /// An added host did not answer its first call (the unit was given back).
    #[error("added host {index}: {source}")]
    Host {
        /// Which host.
        index: usize,
        /// What went wrong.
        source: CallError,
    },
    /// No such unit was added.
    #[error("{0} is not a unit of hosts added to this cluster")]
    Unknown(String),
}

/// How hosts are reached and watched: the settings the cluster's first hosts got.
pub(crate) struct Reach {
    /// The request the first hosts were launched with (`n_hosts` is set per growth).
    req: LaunchRequest,
    /// Client TLS of the cluster's connections.
    tls: Option<ClientTls>,
    /// How actor calls travel.
    calls: CallTransport,
    /// Silence after which a host is lost.
    lost_after: Duration,
    /// Whether the launcher's hosts run in this process.
    same_process: bool,
}

impl Reach {
    /// Hosts launched by `req`, reached with `tls` and `calls`, lost after `lost_after` of
    /// silence unless they run in this process (`same_process`).
    pub(crate) fn new(
        req: LaunchRequest,
        tls: Option<ClientTls>,
        calls: CallTransport,
        (lost_after, same_process): (Duration, bool),
    ) -> Reach {
        Reach {
            req,
            tls,
            calls,
            lost_after,
            same_process,
        }
    }
}

/// One growth: its hosts, and the flag that makes their end a release, not a loss.
struct Unit {
    hosts: Vec<usize>,
    released: Arc<AtomicBool>,
}

#[derive(Default)]
struct State {
    /// The next index a growth may number its hosts from.
    next_index: usize,
    units: BTreeMap<String, Unit>,
    closed: bool,
}

/// The hosts added to one cluster (see the module docs).
pub(crate) struct Growth {
    launcher: Option<Arc<dyn HostLauncher>>,
    reach: Option<Reach>,
    events: EventSinks,
    state: Mutex<State>,
}

impl Growth {
    /// A cluster that cannot grow (hosts in this process, or connected): [`Growth::grow`]
    /// says so.
    pub(crate) fn fixed(events: &EventSinks, first_hosts: usize) -> Arc<Growth> {
        Arc::new(Growth::unlaunched(events, first_hosts))
    }

    fn unlaunched(events: &EventSinks, first_hosts: usize) -> Growth {
        Growth {
            launcher: None,
            reach: None,
            events: events.clone(),
            state: Mutex::new(State {
                next_index: first_hosts,
                ..State::default()
            }),
        }
    }

    /// A cluster of `first_hosts` hosts that `launcher` started and may grow.
    pub(crate) fn launched(
        launcher: Arc<dyn HostLauncher>,
        reach: Reach,
        events: &EventSinks,
        first_hosts: usize,
    ) -> Arc<Growth> {
        Arc::new(Growth {
            launcher: Some(launcher),
            reach: Some(reach),
            ..Growth::unlaunched(events, first_hosts)
        })
    }

    /// Adds `n` hosts through the launcher (one unit, e.g. one Slurm job): its id and the
    /// connected hosts. Nothing of a failed growth keeps running.
    pub(crate) async fn grow(&self, n: usize) -> Result<(String, Vec<HostHandle>), GrowError> {
        let (Some(launcher), Some(reach)) = (&self.launcher, &self.reach) else {
            return Err(GrowError::Launch(
                "this cluster's hosts were not started by a launcher (they run in this process, or were connected by address): no host can be added; a new server must fit on the free GPUs of the hosts it has".into(),
            ));
        };
        let base = {
            let mut s = self.state.lock();
            if s.closed {
                return Err(GrowError::Launch("the cluster is shutting down".into()));
            }
            let b = s.next_index;
            s.next_index += n;
            b
        };
        let req = LaunchRequest {
            n_hosts: n,
            ..reach.req.clone()
        };
        let grown = launcher.grow(&req, base).await.map_err(|e| match e {
            // Already says which launcher and why.
            LaunchError::CannotGrow(why) => GrowError::Launch(why),
            e => GrowError::Launch(format!("{} launcher: {e}", launcher.name())),
        })?;
        let tries = grown.hosts.iter().map(|h| {
            HostConn::grpc(
                &h.addr,
                req.startup_timeout,
                req.token.as_deref(),
                reach.tls.as_ref(),
                reach.calls,
            )
        });
        let mut conns = Vec::new();
        for (h, c) in grown
            .hosts
            .iter()
            .zip(futures::future::join_all(tries).await)
        {
            match c {
                Ok(c) => conns.push((h.index, c)),
                Err(source) => {
                    let _ = launcher.release(&grown.id).await;
                    return Err(GrowError::Host {
                        index: h.index,
                        source,
                    });
                }
            }
        }
        let released = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for (index, (conn, desc)) in conns {
            let opened = conn.watch().await.map_err(|e| e.to_string());
            tokio::spawn(watch_host(
                index,
                conn.clone(),
                opened,
                self.events.clone(),
                (reach.lost_after, reach.same_process),
                released.clone(),
            ));
            handles.push(HostHandle { index, conn, desc });
        }
        let closed = {
            let mut s = self.state.lock();
            s.units.insert(
                grown.id.clone(),
                Unit {
                    hosts: handles.iter().map(HostHandle::index).collect(),
                    released: released.clone(),
                },
            );
            s.closed
        };
        if closed {
            // Shut down meanwhile: the launcher's teardown may have run before this unit
            // was known; give it back here.
            released.store(true, Ordering::Release);
            let _ = launcher.release(&grown.id).await;
            return Err(GrowError::Launch("the cluster is shutting down".into()));
        }
        tracing::info!(unit = %grown.id, hosts = ?handles.iter().map(HostHandle::index).collect::<Vec<_>>(), "hosts added to the cluster");
        Ok((grown.id, handles))
    }

    /// Gives unit `id` back: its hosts' end is not reported as a loss, and the launcher stops
    /// them (Slurm: `scancel`).
    pub(crate) async fn release(&self, id: &str) -> Result<(), GrowError> {
        let Some(unit) = self.state.lock().units.remove(id) else {
            return Err(GrowError::Unknown(id.to_string()));
        };
        unit.released.store(true, Ordering::Release);
        let Some(launcher) = &self.launcher else {
            return Ok(());
        };
        launcher
            .release(id)
            .await
            .map_err(|e| GrowError::Launch(format!("{} launcher: {e}", launcher.name())))?;
        tracing::info!(unit = %id, hosts = ?unit.hosts, "hosts given back");
        Ok(())
    }

    /// The cluster is shutting down: no host's end from now on is a loss, and no growth
    /// starts (the launcher's teardown stops what was added).
    pub(crate) fn close(&self) {
        let mut s = self.state.lock();
        s.closed = true;
        for u in s.units.values() {
            u.released.store(true, Ordering::Release);
        }
    }
}
