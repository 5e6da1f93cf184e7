//! The FP8 benchmark, run on demand (it moves ~0.5 GB and is only meaningful in release):
//! `cargo test --release -p troupe-weights --test fp8_bench -- --ignored --nocapture`.

#[test]
#[ignore = "benchmark: run explicitly, in release"]
fn bench_fp8_reports_quantize_and_memcpy_bandwidth() {
    let kernel = troupe_weights::fp8::Kernel::active().expect("a kernel this CPU runs");
    println!("fp8.kernel {kernel}");
    let figures = troupe_weights::bench::bench_fp8();
    for (metric, value) in &figures {
        println!("{metric} {value:.3}");
    }
    let get = |key: &str| {
        figures
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("missing {key}"))
    };
    for key in ["fp8.quantize.gb_per_s", "fp8.memcpy.gb_per_s"] {
        let v = get(key);
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
}
