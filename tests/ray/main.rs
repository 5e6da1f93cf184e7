//! `scheduler.type: ray` on a real Ray cluster on this machine (`scripts/ray-local.sh start
//! --nodes 3`): hosts on distinct Ray nodes, requests and a weight update through the gateway,
//! a killed host actor's servers re-placed, teardown leaving no placement group and no process,
//! and Ray's own words for a placement group it cannot satisfy.

#[path = "../common/mod.rs"]
mod common;

mod cluster;
mod serve;
