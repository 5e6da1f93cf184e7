//! troupe-actors
