//! Reference engine (being built).
