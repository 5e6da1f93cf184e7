//! The weights crate's integration tests, one binary (each file a module): buckets, the FP8
//! codec's properties and reference vectors, the offline quantizer, the FP8 bench.

mod buckets;
mod fp8_bench;
mod fp8_properties;
mod fp8_vectors;
mod quantize_file;
