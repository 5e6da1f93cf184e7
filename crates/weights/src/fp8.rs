//! FP8 block-wise codec (being built).
