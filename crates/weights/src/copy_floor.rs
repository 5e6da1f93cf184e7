//! The copy floor of a broadcast on one machine: what `n` receivers cost when nothing but their
//! unavoidable work runs (`broadcast.receivers_<n>.floor_seconds`).
//!
//! Engines on rank 0's machine each need a private copy of the weights, so `n` of them write
//! `n` times the payload to memory however the bytes reach them. This runs exactly that work
//! with no protocol around it: `n` destination buffers of the payload's size, each filled from
//! a cache-resident source the size of the ring with the ring's streaming copy, interleaved in
//! the ring's steps, on as many threads as there are cores (at most `n`). Its time against one
//! receiver's is the bound the machine sets: `n / min(n, cores)` when copies are limited by the
//! cores, more when they are limited by memory bandwidth (on the 2-core VM of the README, one
//! thread copies ~25 GB/s alone, and two share ~50 GB/s in bursts but ~27 GB/s sustained).

use std::time::Instant;

use crate::tcp::ring::{append_streaming, publish_every};

/// Best time in seconds of `runs` fillings (after one warm-up that touches every page) of `n`
/// buffers of `bytes` bytes each from a `ring`-byte source.
pub fn copy_floor(n: usize, bytes: usize, ring: usize, runs: usize) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = n.clamp(1, cores);
    let ring = ring.clamp(1, bytes.max(1));
    let step = publish_every(ring);
    let source: Vec<u8> = (0..ring).map(|i| (i * 31 + 7) as u8).collect();
    let mut dests: Vec<Vec<u8>> = (0..n).map(|_| Vec::with_capacity(bytes)).collect();
    let mut best = f64::INFINITY;
    for run in 0..=runs {
        let start = Instant::now();
        fill(&mut dests, &source, bytes, step, threads);
        if run > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    best
}

/// Fills each of `dests` with `bytes` bytes: `source` over and over, `step` bytes at a time
/// for each buffer in turn, the buffers shared out among `threads` threads.
fn fill(dests: &mut [Vec<u8>], source: &[u8], bytes: usize, step: usize, threads: usize) {
    let ring = source.len();
    std::thread::scope(|s| {
        let mut shares: Vec<Vec<&mut Vec<u8>>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, d) in dests.iter_mut().enumerate() {
            d.clear();
            shares[i % threads].push(d);
        }
        for mut mine in shares {
            s.spawn(move || {
                let mut at = 0;
                while at < bytes {
                    // One ring step for each of this thread's receivers in turn, as receivers
                    // follow rank 0 through the ring together.
                    let off = at % ring;
                    let k = step.min(ring - off).min(bytes - at);
                    for d in mine.iter_mut() {
                        append_streaming(d, &source[off..off + k]);
                    }
                    at += k;
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_buffer_gets_the_source_over_and_over() {
        let source: Vec<u8> = (0..(256u32 << 10) + 3).map(|i| (i % 251) as u8).collect();
        let bytes = (1 << 20) + 5;
        let mut dests = vec![Vec::new(); 3];
        fill(&mut dests, &source, bytes, 100 << 10, 2);
        let want: Vec<u8> = source.iter().copied().cycle().take(bytes).collect();
        for d in &dests {
            assert!(d == &want);
        }
    }

    #[test]
    fn fills_every_buffer_and_times_it() {
        let t = copy_floor(3, 1 << 20, 256 << 10, 1);
        assert!(t > 0.0 && t.is_finite());
        // An empty payload costs nothing and does not divide by zero.
        assert!(copy_floor(1, 0, 0, 1).is_finite());
    }
}
