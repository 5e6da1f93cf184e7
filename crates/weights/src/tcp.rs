//! TCP weight transport (being built).
