//! Throughput of the FP8 quantizer beside the machine's copy bandwidth (`troupe bench fp8`).
//!
//! Quantizing is meant to be memory-bound: it reads 2 bytes and writes 1 per bf16 element, while a
//! copy reads and writes the same bytes. So the copy of the same input, on the same machine and
//! with the same threads, is the physical yardstick; the target is at least 80% of it, on
//! AVX2-only and on AVX-512 CPUs. The figures are those of the kernel [`Kernel::active`] names
//! (the fastest this CPU runs, or the one `TROUPE_FP8_KERNEL` forces); callers print it beside
//! them as `fp8.kernel NAME`.

use std::hint::black_box;
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;

#[cfg(doc)]
use crate::fp8::Kernel;
use crate::fp8::{self, Fp8Options, Granularity, Weights};

/// Rows of the benchmark matrix (a Llama-3-8B-sized MLP projection).
pub const BENCH_ROWS: usize = 4096;
/// Columns of the benchmark matrix.
pub const BENCH_COLS: usize = 14336;
/// Timed repetitions of each measurement; the fastest is reported.
const RUNS: usize = 9;
/// Bytes per rayon task of the parallel copy.
const COPY_CHUNK: usize = 1 << 20;

/// Runs the FP8 benchmark on a 4096 x 14336 bf16 matrix and returns `(metric, value)` pairs.
///
/// - `fp8.quantize.gb_per_s`: input bytes / best time of a 128x128 block quantization into
///   reused buffers (the steady state of a weight sync);
/// - `fp8.quantize_alloc.gb_per_s`: the same through [`fp8::quantize`], allocating its output
///   (fresh pages are faulted in, which costs more than the quantization on some VMs);
/// - `fp8.memcpy.gb_per_s`: input bytes / best time of copying them with all rayon threads into
///   a reused buffer, timed alternately with the quantization;
/// - `fp8.quantize.fraction_of_memcpy`: the first over the third (target >= 0.8);
/// - `fp8.threads`: rayon threads used.
pub fn bench_fp8() -> Vec<(String, f64)> {
    let input = bench_matrix(BENCH_ROWS, BENCH_COLS);
    let bytes = (input.len() * std::mem::size_of::<bf16>()) as f64;
    let opts = Fp8Options {
        granularity: Granularity::default(),
        ..Fp8Options::default()
    };
    let name = "bench.weight";
    let scale_count = opts.granularity.scale_count(BENCH_ROWS, BENCH_COLS);

    let mut data = vec![0u8; input.len()];
    let mut scales = vec![0f32; scale_count];
    let src: &[u8] = as_bytes(&input);
    let mut dst = vec![0u8; src.len()];
    let mut quantize = || {
        // The input is generated finite, so this cannot fail; a failure would be a codec bug
        // that the bench must not hide behind a fast number.
        if let Err(e) = fp8::quantize_into(
            name,
            BENCH_ROWS,
            BENCH_COLS,
            Weights::Bf16(&input),
            &opts,
            &mut data,
            &mut scales,
        ) {
            panic!("fp8 bench: {e}");
        }
        black_box((&data, &scales));
    };
    let mut memcpy = || {
        dst.par_chunks_mut(COPY_CHUNK)
            .zip(src.par_chunks(COPY_CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&dst);
    };
    // Warm-up faults in every page; then the two are timed alternately, so that load from other
    // processes on a shared machine hits both alike.
    quantize();
    memcpy();
    let mut quantize_times = Vec::with_capacity(RUNS);
    let mut memcpy_times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        quantize_times.push(seconds(&mut quantize));
        memcpy_times.push(seconds(&mut memcpy));
    }
    let quantize = best(&quantize_times);
    let memcpy = best(&memcpy_times);
    let quantize_alloc = best(
        &(0..RUNS / 2)
            .map(|_| {
                seconds(|| {
                    match fp8::quantize(name, BENCH_ROWS, BENCH_COLS, Weights::Bf16(&input), &opts)
                    {
                        Ok(q) => drop(black_box(q)),
                        Err(e) => panic!("fp8 bench: {e}"),
                    }
                })
            })
            .collect::<Vec<_>>(),
    );

    let gbps = |secs: f64| bytes / secs / 1e9;
    vec![
        ("fp8.quantize.gb_per_s".into(), gbps(quantize)),
        ("fp8.quantize_alloc.gb_per_s".into(), gbps(quantize_alloc)),
        ("fp8.memcpy.gb_per_s".into(), gbps(memcpy)),
        ("fp8.quantize.fraction_of_memcpy".into(), memcpy / quantize),
        ("fp8.threads".into(), rayon::current_num_threads() as f64),
    ]
}

/// Wall time of one call.
fn seconds(mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// The fastest run: the one least disturbed by other work on the machine.
fn best(times: &[f64]) -> f64 {
    times.iter().copied().fold(f64::INFINITY, f64::min)
}

/// A deterministic weight-like matrix: roughly normal values of scale 0.02.
fn bench_matrix(rows: usize, cols: usize) -> Vec<bf16> {
    let mut state = 0x853C_49E6_748F_EA9Bu64;
    (0..rows * cols)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Sum of four 16-bit uniforms: a cheap bell curve.
            let s: u64 = (0..4).map(|k| (state >> (16 * k)) & 0xFFFF).sum();
            bf16::from_f32((s as f32 / 131_070.0 - 1.0) * 0.04)
        })
        .collect()
}

/// The bf16 matrix as its bytes, for the copy.
fn as_bytes(v: &[bf16]) -> &[u8] {
    // SAFETY: bf16 is a plain 2-byte value with no padding and no invalid bit patterns; u8 has
    // alignment 1, and the length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
