//! The scheduler's integration tests, one binary: the allocation DSL's accepted and refused
//! forms, YAML configs, `troupe alloc`'s golden outputs, placement, re-placement, properties.

mod config;
mod dsl_table;
mod golden;
mod placement;
mod properties;
mod replacement;
