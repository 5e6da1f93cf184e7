//! Allocation DSL and placement (being built).
