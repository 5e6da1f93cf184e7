//! Troupe facade.
