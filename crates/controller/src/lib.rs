//! troupe-controller
