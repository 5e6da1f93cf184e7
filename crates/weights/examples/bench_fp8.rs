//! Prints the FP8 quantizer benchmark: `cargo run --release -p troupe-weights --example bench_fp8`.
//!
//! Each line is `metric value` (the first `fp8.kernel NAME`), the lines `troupe bench fp8` prints.

fn main() {
    match troupe_weights::fp8::Kernel::active() {
        Ok(kernel) => println!("fp8.kernel {kernel}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
    for (metric, value) in troupe_weights::bench::bench_fp8() {
        println!("{metric} {value:.3}");
    }
}
