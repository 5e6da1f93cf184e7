//! The port cursor relay: per host, a cursor over a port range that only moves forward.
//!
//! Each instance takes its ports from its host's cursor (HTTP, dist-init, and a bootstrap port
//! for prefill servers); the next instance and the next group continue where the last stopped, so
//! ports never collide across groups and the result is deterministic. Before a port is handed out
//! it is checked with a [`PortProbe`]; taken ports are skipped. A launcher that still hits
//! `EADDRINUSE` asks [`PortAllocator::replace`] for fresh ones.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::SchedulerError;
use crate::hosts::HostResources;

/// An inclusive range of TCP ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRange {
    /// First port handed out.
    pub start: u16,
    /// Last port handed out (inclusive).
    pub end: u16,
}

impl Default for PortRange {
    /// 10000–32767: below Linux's ephemeral range, so the OS rarely hands these out itself.
    fn default() -> Self {
        PortRange {
            start: 10000,
            end: 32767,
        }
    }
}

impl PortRange {
    /// How many ports the range holds.
    pub fn len(&self) -> u32 {
        (u32::from(self.end) + 1).saturating_sub(u32::from(self.start))
    }

    /// Never true for a checked range; here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.end < self.start
    }

    /// A checked range: `0 < start <= end`.
    pub fn new(start: u16, end: u16) -> Result<PortRange, SchedulerError> {
        if start == 0 {
            return Err(SchedulerError::PortRange {
                start,
                end,
                message: "port 0 means \"any port\" and cannot be handed out".into(),
            });
        }
        if start > end {
            return Err(SchedulerError::PortRange {
                start,
                end,
                message: "the start is after the end".into(),
            });
        }
        Ok(PortRange { start, end })
    }
}

/// Tells whether a port is free on a host before it is handed out.
///
/// It exists because only the machine that owns a port can really probe it: the controller
/// probes hosts on its own machine with [`LocalBindProbe`], previews and remote hosts use
/// [`AssumeFree`] (the remote launcher then reports `EADDRINUSE` and calls
/// [`PortAllocator::replace`]), and tests plug in their own.
pub trait PortProbe: Send + Sync + fmt::Debug {
    /// Whether `port` can be bound on `host` right now.
    fn is_free(&self, host: &HostResources, port: u16) -> bool;
}

/// Assumes every port is free: for plan previews (`troupe alloc`) and hosts probed remotely.
#[derive(Debug, Clone, Copy, Default)]
pub struct AssumeFree;

impl PortProbe for AssumeFree {
    fn is_free(&self, _host: &HostResources, _port: u16) -> bool {
        true
    }
}

/// Probes by binding `0.0.0.0:port` on this machine (and releasing it at once); use it for hosts
/// that run on the same machine as the caller.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalBindProbe;

impl PortProbe for LocalBindProbe {
    fn is_free(&self, _host: &HostResources, port: u16) -> bool {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
    }
}

/// Which ports one instance needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortNeeds {
    /// The server's HTTP port.
    pub http: bool,
    /// The dist-init (NCCL / torch.distributed rendezvous) port.
    pub dist: bool,
    /// The PD bootstrap port (prefill servers).
    pub bootstrap: bool,
}

/// The ports one instance was given; absent fields were not needed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InstancePorts {
    /// HTTP port of the server.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub http: Option<u16>,
    /// Dist-init port (head node / rank 0 only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dist: Option<u16>,
    /// PD bootstrap port (prefill only, unless decode bootstrap ports are asked for).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bootstrap: Option<u16>,
}

impl InstancePorts {
    /// The ports that are set, in `http, dist, bootstrap` order.
    pub fn all(&self) -> Vec<u16> {
        [self.http, self.dist, self.bootstrap]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Which ports these are, so a replacement has the same shape.
    pub fn needs(&self) -> PortNeeds {
        PortNeeds {
            http: self.http.is_some(),
            dist: self.dist.is_some(),
            bootstrap: self.bootstrap.is_some(),
        }
    }
}

/// Per-host port cursors over one range, with a probe.
///
/// It exists so that every port decision (initial placement and relaunch after `EADDRINUSE`)
/// goes through one forward-only cursor per host: a port is never handed out twice.
///
/// Hosts that share a network address share one cursor: several actor hosts on one machine (a
/// laptop, a CI box, in-process test clusters) share that machine's port space.
#[derive(Debug, Clone)]
pub struct PortAllocator {
    range: PortRange,
    probe: Arc<dyn PortProbe>,
    /// Where in the range the cursors start, as an offset from `range.start` (0: at the start).
    origin: u32,
    /// Per port space: how many ports of the range the cursor has moved past.
    cursors: BTreeMap<String, u32>,
}

impl PortAllocator {
    /// An allocator whose cursors all start at `range.start` (deterministic: previews, tests).
    pub fn new(range: PortRange, probe: Arc<dyn PortProbe>) -> Self {
        PortAllocator {
            range,
            probe,
            origin: 0,
            cursors: BTreeMap::new(),
        }
    }

    /// An allocator whose cursors start at a random point of `range` and wrap around, for live
    /// deployments: two deployments started at the same moment on one machine (two experiments
    /// on a node, a test run beside a job) then draw from different parts of the range instead
    /// of racing for the same first ports. The probe, the controller's claims and the relaunch
    /// on `EADDRINUSE` handle whatever collisions remain.
    pub fn randomized(range: PortRange, probe: Arc<dyn PortProbe>) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        let origin = (h.finish() % u64::from(range.len().max(1))) as u32;
        PortAllocator {
            origin,
            ..PortAllocator::new(range, probe)
        }
    }

    /// The default range 10000–32767 with no probing (previews, tests).
    pub fn preview() -> Self {
        PortAllocator::new(PortRange::default(), Arc::new(AssumeFree))
    }

    /// The range ports come from.
    pub fn range(&self) -> PortRange {
        self.range
    }

    /// The next port the cursor of `host` will consider (one past the range's end once it
    /// has gone all the way round).
    pub fn cursor(&self, host: &HostResources) -> u32 {
        let moved = self.moved(host);
        if moved >= self.range.len() {
            return u32::from(self.range.end) + 1;
        }
        self.port_at(moved)
    }

    fn moved(&self, host: &HostResources) -> u32 {
        self.cursors.get(&port_space(host)).copied().unwrap_or(0)
    }

    /// The port `moved` steps after the origin, wrapping at the range's end.
    fn port_at(&self, moved: u32) -> u32 {
        u32::from(self.range.start) + (self.origin + moved) % self.range.len()
    }

    /// Hands out the next free port of `host`, skipping ports the probe reports as taken.
    pub fn take(&mut self, host: &HostResources) -> Result<u16, SchedulerError> {
        let mut moved = self.moved(host);
        while moved < self.range.len() {
            let candidate = u16::try_from(self.port_at(moved)).unwrap_or(u16::MAX);
            moved += 1;
            if self.probe.is_free(host, candidate) {
                self.cursors.insert(port_space(host), moved);
                return Ok(candidate);
            }
        }
        Err(SchedulerError::PortsExhausted {
            host: host.index,
            start: self.range.start,
            end: self.range.end,
        })
    }

    /// Hands out the ports of one instance in `http, dist, bootstrap` order; all or nothing.
    pub fn take_ports(
        &mut self,
        host: &HostResources,
        needs: PortNeeds,
    ) -> Result<InstancePorts, SchedulerError> {
        // Only this host's cursor moves; put it back if any port cannot be had.
        let key = port_space(host);
        let saved = self.cursors.get(&key).copied();
        let mut take = |wanted: bool| -> Result<Option<u16>, SchedulerError> {
            if wanted {
                self.take(host).map(Some)
            } else {
                Ok(None)
            }
        };
        let result = (|| {
            Ok(InstancePorts {
                http: take(needs.http)?,
                dist: take(needs.dist)?,
                bootstrap: take(needs.bootstrap)?,
            })
        })();
        if result.is_err() {
            match saved {
                Some(cursor) => self.cursors.insert(key, cursor),
                None => self.cursors.remove(&key),
            };
        }
        result
    }

    /// Fresh ports of the same shape as `old`, for a launcher that hit `EADDRINUSE` on `host`.
    /// The old ports stay behind the cursor and are never handed out again.
    pub fn replace(
        &mut self,
        host: &HostResources,
        old: &InstancePorts,
    ) -> Result<InstancePorts, SchedulerError> {
        self.take_ports(host, old.needs())
    }
}

/// The port space a host draws from: its network address without any port, or its index when
/// it has no address.
fn port_space(host: &HostResources) -> String {
    let a = host.address.trim();
    if a.is_empty() {
        return format!("#{}", host.index);
    }
    // "10.0.0.1:7000" and "[::1]:7000" name a machine plus a port; keep only the machine.
    match a.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.is_empty() => {
            h.trim_start_matches('[').trim_end_matches(']').to_string()
        }
        _ => a.to_string(),
    }
}
