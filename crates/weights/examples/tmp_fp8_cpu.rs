use half::bf16;
use troupe_weights::fp8::{self, Fp8Options, Weights};
fn cpu_ticks() -> u64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}
fn main() {
    let (rows, cols) = (4096, 14336);
    let mut st = 1u64;
    let input: Vec<bf16> = (0..rows * cols).map(|_| { st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); bf16::from_f32(((st >> 40) as f32 / 16777216.0 - 0.5) * 0.04) }).collect();
    let opts = Fp8Options::default();
    let mut data = vec![0u8; input.len()];
    let mut scales = vec![0f32; 32 * 112];
    let reps = 20;
    fp8::quantize_into("w", rows, cols, Weights::Bf16(&input), &opts, &mut data, &mut scales).unwrap();
    let t0 = cpu_ticks(); let w0 = std::time::Instant::now();
    for _ in 0..reps { fp8::quantize_into("w", rows, cols, Weights::Bf16(&input), &opts, &mut data, &mut scales).unwrap(); }
    let t1 = cpu_ticks(); let wall = w0.elapsed().as_secs_f64();
    let cpu = (t1 - t0) as f64 / 100.0;
    let bytes = (input.len() * 2 * reps) as f64;
    println!("quantize: cpu {:.2}s -> {:.2} GB/s per cpu-second; wall {:.2} GB/s", cpu, bytes / cpu / 1e9, bytes / wall / 1e9);
    let mut dst = vec![0u8; input.len() * 2];
    let src: &[u8] = unsafe { std::slice::from_raw_parts(input.as_ptr().cast(), input.len() * 2) };
    dst.copy_from_slice(src);
    let t0 = cpu_ticks(); let w0 = std::time::Instant::now();
    for _ in 0..reps { dst.copy_from_slice(src); std::hint::black_box(&dst); }
    let t1 = cpu_ticks(); let wall = w0.elapsed().as_secs_f64();
    let cpu = (t1 - t0) as f64 / 100.0;
    println!("memcpy 1t: cpu {:.2}s -> {:.2} GB/s per cpu-second; wall {:.2} GB/s", cpu, bytes / cpu / 1e9, bytes / wall / 1e9);
}
