//! The serving crate's integration tests, one binary (each file a module): admin routes, the
//! gateway, its limits, pass-through, the data proxy, registration, routing, sessions,
//! streaming. `server_env.rs` and `threads.rs` are binaries of their own (see Cargo.toml).

mod support;

mod admin;
mod gateway;
mod limits;
mod passthrough;
mod proxy;
mod registration;
mod routing;
mod sessions;
mod stream;
