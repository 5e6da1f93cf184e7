//! Hosts on other machines: network namespaces on one machine, and a local Slurm cluster.

#[path = "../common/mod.rs"]
mod common;

mod netns;
mod slurm;
mod slurm_grow;
