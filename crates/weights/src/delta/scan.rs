//! Finding what changed between two versions of a block: the one pass over both that a delta
//! costs the sender, so it runs at memory speed (a vector check per 64 bytes, and in a run that
//! differs, one mask per word), and the checksum's sum of the new version in the same pass.

use super::sum::{KEY_STEP, words_sum};

/// Counts the `elem`-byte elements where `a` and `b` differ, and pushes their indices while
/// there are at most `limit`. Runs of 64 bytes are checked first with one vectorizable XOR-OR
/// (most runs are equal in a sparse step); in a run that differs, each 8-byte word's changed
/// elements come out of one mask (a bit at the top of every nonzero lane of the XOR).
pub(crate) fn changed_indices(
    a: &[u8],
    b: &[u8],
    elem: usize,
    limit: usize,
    idx: &mut Vec<u16>,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("popcnt")
        && std::arch::is_x86_feature_detected!("bmi1")
    {
        // SAFETY: this CPU has every feature the function is compiled for.
        return unsafe { changed_indices_x86(a, b, elem, limit, idx) };
    }
    changed_indices_any(a, b, elem, limit, idx)
}

/// Dispatches to the loop compiled for this element size (so every division by it is a shift).
#[inline(always)]
fn changed_indices_any(a: &[u8], b: &[u8], elem: usize, limit: usize, idx: &mut Vec<u16>) -> usize {
    match elem {
        1 => changed_indices_portable::<1>(a, b, limit, idx),
        2 => changed_indices_portable::<2>(a, b, limit, idx),
        _ => changed_indices_portable::<4>(a, b, limit, idx),
    }
}

/// [`changed_indices`] compiled for AVX2 (the run check is two vector loads, an XOR and an OR),
/// POPCNT and BMI1 (the count and the walk over a word's changed lanes are one instruction
/// each, not a dozen).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt,bmi1")]
fn changed_indices_x86(a: &[u8], b: &[u8], elem: usize, limit: usize, idx: &mut Vec<u16>) -> usize {
    changed_indices_any(a, b, elem, limit, idx)
}

/// Lane masks for `ELEM`-byte elements: all bits but each lane's top one, and each lane's top
/// bit.
const fn lanes<const ELEM: usize>() -> (u64, u64) {
    match ELEM {
        1 => (0x7F7F_7F7F_7F7F_7F7F, 0x8080_8080_8080_8080),
        2 => (0x7FFF_7FFF_7FFF_7FFF, 0x8000_8000_8000_8000),
        _ => (0x7FFF_FFFF_7FFF_FFFF, 0x8000_0000_8000_0000),
    }
}

#[inline(always)]
fn word(s: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&s[..8]);
    u64::from_le_bytes(w)
}

/// The changed elements of run `r` (64 bytes `x` against `y`, known to differ): counted, and
/// their indices pushed while there are at most `limit`.
#[inline(always)]
fn run_changes<const ELEM: usize>(
    x: &[u8],
    y: &[u8],
    r: usize,
    limit: usize,
    idx: &mut Vec<u16>,
) -> usize {
    let (low, top) = lanes::<ELEM>();
    let lane_bits = 8 * ELEM as u32;
    let mut count = 0usize;
    for k in 0..RUN / 8 {
        let d = word(&x[8 * k..]) ^ word(&y[8 * k..]);
        if d == 0 {
            continue;
        }
        // The add cannot carry out of a lane: both terms are below the lane's top bit.
        let mut m = (((d & low) + low) | d) & top;
        count += m.count_ones() as usize;
        if idx.len() <= limit {
            let first = ((r * RUN + 8 * k) / ELEM) as u32;
            while m != 0 {
                idx.push((first + m.trailing_zeros() / lane_bits) as u16);
                m &= m - 1;
            }
        }
    }
    count
}

/// Bytes per run checked at once.
const RUN: usize = 64;

/// How far ahead of the run being checked [`summed_x86`] asks for both versions' lines.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 2048;

/// For a byte mask of a run, the bit of each element's lowest byte, by element size - 1.
#[cfg(target_arch = "x86_64")]
const ELEM_BITS: [u64; 4] = [u64::MAX, 0x5555_5555_5555_5555, 0, 0x1111_1111_1111_1111];

/// The elements after the last whole run.
#[inline(always)]
fn tail_changes<const ELEM: usize>(a: &[u8], b: &[u8], limit: usize, idx: &mut Vec<u16>) -> usize {
    let mut count = 0;
    for e in (a.len() / RUN * RUN / ELEM)..(a.len() / ELEM) {
        if a[e * ELEM..(e + 1) * ELEM] != b[e * ELEM..(e + 1) * ELEM] {
            count += 1;
            if idx.len() <= limit {
                idx.push(e as u16);
            }
        }
    }
    count
}

#[inline(always)]
fn changed_indices_portable<const ELEM: usize>(
    a: &[u8],
    b: &[u8],
    limit: usize,
    idx: &mut Vec<u16>,
) -> usize {
    let mut count = 0usize;
    for (r, (x, y)) in a.chunks_exact(RUN).zip(b.chunks_exact(RUN)).enumerate() {
        let mut any = 0u64;
        for k in 0..RUN / 8 {
            any |= word(&x[8 * k..]) ^ word(&y[8 * k..]);
        }
        if any != 0 {
            count += run_changes::<ELEM>(x, y, r, limit, idx);
        }
    }
    count + tail_changes::<ELEM>(a, b, limit, idx)
}

/// [`changed_indices`] of a block, and the checksum's sum over the words of `b` (the new
/// version; its first word is word `first` of the tensor), in one pass over both: on AVX2 the
/// sum of each run is taken from the registers its check loaded.
pub(crate) fn changed_indices_summed(
    a: &[u8],
    b: &[u8],
    elem: usize,
    limit: usize,
    idx: &mut Vec<u16>,
    first: u64,
) -> (usize, u64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("popcnt")
        && std::arch::is_x86_feature_detected!("bmi1")
    {
        // SAFETY: this CPU has every feature the function is compiled for.
        return unsafe {
            match elem {
                1 => summed_x86::<1>(a, b, limit, idx, first),
                2 => summed_x86::<2>(a, b, limit, idx, first),
                _ => summed_x86::<4>(a, b, limit, idx, first),
            }
        };
    }
    let count = changed_indices_any(a, b, elem, limit, idx);
    (count, words_sum(first, b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt,bmi1")]
fn summed_x86<const ELEM: usize>(
    a: &[u8],
    b: &[u8],
    limit: usize,
    idx: &mut Vec<u16>,
    first: u64,
) -> (usize, u64) {
    use std::arch::x86_64::*;
    let key = |i: u64| first.wrapping_add(1 + i).wrapping_mul(KEY_STEP) as i64;
    let mut k0 = _mm256_set_epi64x(key(3), key(2), key(1), key(0));
    let mut k1 = _mm256_set_epi64x(key(7), key(6), key(5), key(4));
    let step = _mm256_set1_epi64x(KEY_STEP.wrapping_mul(8) as i64);
    let mut acc = _mm256_setzero_si256();
    let mut count = 0usize;
    let runs = a.len().min(b.len()) / RUN;
    // Indices are written into room made up front: a push that may grow the vector is a call,
    // around which every vector register of the loop would be spilled.
    let (start, room) = (
        idx.len(),
        limit.saturating_add(RUN).min(runs * RUN / ELEM + RUN),
    );
    idx.resize(start + room, 0);
    let mut kept = start;
    for (r, (x, y)) in a.chunks_exact(RUN).zip(b.chunks_exact(RUN)).enumerate() {
        // Both versions are asked for a little ahead: with two streams to read (and the
        // indices to write) the hardware prefetcher alone left the loop waiting on memory
        // (measured: a third faster with this).
        let ahead = (r * RUN + PREFETCH_BYTES).min(runs * RUN - 1);
        // SAFETY: a prefetch reads nothing architecturally; both addresses are inside `a` and
        // `b` anyway (`runs * RUN` bytes of each).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(a.as_ptr().add(ahead).cast());
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().add(ahead).cast());
        }
        // SAFETY: `x` and `y` hold 64 readable bytes each; the loads are unaligned.
        let (x0, x1, y0, y1) = unsafe {
            (
                _mm256_loadu_si256(x.as_ptr().cast()),
                _mm256_loadu_si256(x[32..].as_ptr().cast()),
                _mm256_loadu_si256(y.as_ptr().cast()),
                _mm256_loadu_si256(y[32..].as_ptr().cast()),
            )
        };
        let s0 = _mm256_add_epi32(y0, k0);
        let s1 = _mm256_add_epi32(y1, k1);
        let p0 = _mm256_mul_epu32(s0, _mm256_srli_epi64::<32>(s0));
        let p1 = _mm256_mul_epu32(s1, _mm256_srli_epi64::<32>(s1));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(p0, y0));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(p1, y1));
        k0 = _mm256_add_epi64(k0, step);
        k1 = _mm256_add_epi64(k1, step);
        // One bit per changed byte of the run, from a lane compare (a changed element sets
        // all of its bytes' bits); its lowest byte's bit stands for the element.
        let (e0, e1) = match ELEM {
            1 => (_mm256_cmpeq_epi8(x0, y0), _mm256_cmpeq_epi8(x1, y1)),
            2 => (_mm256_cmpeq_epi16(x0, y0), _mm256_cmpeq_epi16(x1, y1)),
            _ => (_mm256_cmpeq_epi32(x0, y0), _mm256_cmpeq_epi32(x1, y1)),
        };
        let same = u64::from(_mm256_movemask_epi8(e0) as u32)
            | (u64::from(_mm256_movemask_epi8(e1) as u32) << 32);
        let mut m = !same & ELEM_BITS[ELEM - 1];
        if m != 0 {
            let n = m.count_ones() as usize;
            count += n;
            // Indices are kept while they fit the limit; past it only the count matters.
            if kept - start + n <= limit {
                let at = ((r * RUN) / ELEM) as u32;
                for slot in &mut idx[kept..kept + n] {
                    *slot = (at + m.trailing_zeros() / ELEM as u32) as u16;
                    m &= m - 1;
                }
                kept += n;
            }
        }
    }
    idx.truncate(kept);
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
    let head = lanes.iter().fold(0u64, |s, &l| s.wrapping_add(l));
    let rest = words_sum(first + (runs * RUN / 8) as u64, &b[runs * RUN..]);
    (
        count + tail_changes::<ELEM>(a, b, limit, idx),
        head.wrapping_add(rest),
    )
}

#[cfg(test)]
mod tests {
    use super::super::sum::test_bytes as data;
    use super::*;

    /// The vector scan finds exactly the elements the portable one does, in order, and sums
    /// what [`words_sum`] does, for every element size, changes of one byte of an element or
    /// all of them, in runs and in the tail.
    #[test]
    fn the_vector_scan_matches_the_portable_one() {
        for (elem, len, every) in [(1, 4096 + 7, 3), (2, 8192 + 6, 11), (4, 4096 + 12, 5)] {
            let a = data(len, elem as u64);
            let mut b = a.clone();
            let mut s = 99u64;
            for (i, x) in b.iter_mut().enumerate() {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                if (s >> 33).is_multiple_of(every) || i + 3 >= len {
                    *x ^= 1 << (i % 8);
                }
            }
            for limit in [0usize, 5, len] {
                let mut want = Vec::new();
                let n = changed_indices_any(&a, &b, elem, limit, &mut want);
                let mut got = Vec::new();
                let (m, sum) = changed_indices_summed(&a, &b, elem, limit, &mut got, 17);
                assert_eq!(m, n, "elem {elem} limit {limit}");
                assert_eq!(sum, words_sum(17, &b));
                if n <= limit {
                    assert_eq!(got, want, "elem {elem} limit {limit}");
                }
                assert!(n > len / elem / 20, "the test changes enough: {n}");
            }
        }
    }
}
