//! Prints the FP8 quantizer benchmark: `cargo run --release -p troupe-weights --example bench_fp8`.
//!
//! Each line is `metric value`, the same lines `troupe bench fp8` prints.

fn main() {
    for (metric, value) in troupe_weights::bench::bench_fp8() {
        println!("{metric} {value:.3}");
    }
}
