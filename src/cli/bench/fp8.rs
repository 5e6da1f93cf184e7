//! `troupe bench fp8`: the FP8 quantizer's figures, with the kernel that produced them.
//!
//! The kernel is printed because the figures depend on it (scalar, AVX2 or AVX-512 loops, picked
//! at run time or forced with `TROUPE_FP8_KERNEL`), so a figure copied into a table says which
//! code it measured.

use std::process::ExitCode;

use troupe_weights::fp8::Kernel;

/// Prints `fp8.kernel NAME`, then one line per figure of [`troupe_weights::bench::bench_fp8`]
/// (or one JSON object holding both); fails before measuring anything when `TROUPE_FP8_KERNEL`
/// names no kernel or one this CPU cannot run.
pub fn run(json: bool) -> ExitCode {
    let kernel = match Kernel::active() {
        Ok(k) => k,
        Err(e) => return crate::cli::fail(e),
    };
    let figures = troupe_weights::bench::bench_fp8();
    if json {
        let mut m = serde_json::Map::new();
        m.insert("fp8.kernel".into(), kernel.name().into());
        for (k, v) in &figures {
            m.insert(k.clone(), serde_json::json!(super::rounded(*v)));
        }
        crate::cli::out(&serde_json::Value::Object(m));
    } else {
        crate::cli::out(&format!("fp8.kernel {kernel}"));
        super::print_figures(&figures, false);
    }
    ExitCode::SUCCESS
}
