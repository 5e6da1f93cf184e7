//! The actor runtime through the controller: in-process hosts and `troupe host` subprocesses.

#[path = "../common/mod.rs"]
mod common;

mod framed;
mod inprocess;
mod processes;
