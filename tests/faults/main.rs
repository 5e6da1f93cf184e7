//! Fault tolerance: dead servers and hosts, the chaos benchmark, `--recover`.

#[path = "../common/mod.rs"]
mod common;

mod chaos;
mod elastic;
mod fault_tolerance;
mod orphans;
mod recover;
