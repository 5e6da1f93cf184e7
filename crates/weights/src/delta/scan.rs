//! Finding what changed between two versions of a block: the one pass over both that a delta
//! costs the sender, so it runs at memory speed (a vector check per 64 bytes, and in a run that
//! differs, one mask per word).

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

#[inline(always)]
fn changed_indices_portable<const ELEM: usize>(
    a: &[u8],
    b: &[u8],
    limit: usize,
    idx: &mut Vec<u16>,
) -> usize {
    const RUN: usize = 64;
    let elem = ELEM;
    // Lane masks: all bits but each lane's top one, and each lane's top bit.
    let (low, top): (u64, u64) = match elem {
        1 => (0x7F7F_7F7F_7F7F_7F7F, 0x8080_8080_8080_8080),
        2 => (0x7FFF_7FFF_7FFF_7FFF, 0x8000_8000_8000_8000),
        _ => (0x7FFF_FFFF_7FFF_FFFF, 0x8000_0000_8000_0000),
    };
    let word = |s: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        u64::from_le_bytes(w)
    };
    let lane_bits = 8 * elem as u32;
    let mut count = 0usize;
    let runs = a.len() / RUN;
    for (r, (x, y)) in a.chunks_exact(RUN).zip(b.chunks_exact(RUN)).enumerate() {
        let mut any = 0u64;
        for k in 0..RUN / 8 {
            any |= word(&x[8 * k..8 * k + 8]) ^ word(&y[8 * k..8 * k + 8]);
        }
        if any == 0 {
            continue;
        }
        for k in 0..RUN / 8 {
            let d = word(&x[8 * k..8 * k + 8]) ^ word(&y[8 * k..8 * k + 8]);
            if d == 0 {
                continue;
            }
            // The add cannot carry out of a lane: both terms are below the lane's top bit.
            let mut m = (((d & low) + low) | d) & top;
            count += m.count_ones() as usize;
            if idx.len() <= limit {
                let first = ((r * RUN + 8 * k) / elem) as u32;
                while m != 0 {
                    idx.push((first + m.trailing_zeros() / lane_bits) as u16);
                    m &= m - 1;
                }
            }
        }
    }
    for e in (runs * RUN / elem)..(a.len() / elem) {
        if a[e * elem..(e + 1) * elem] != b[e * elem..(e + 1) * elem] {
            count += 1;
            if idx.len() <= limit {
                idx.push(e as u16);
            }
        }
    }
    count
}
