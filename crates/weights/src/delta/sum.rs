//! The per-tensor checksum of a delta's result: a sum over the tensor's 8-byte words that a
//! receiver keeps up to date as it applies a delta, in time proportional to what changed.
//!
//! Why not a plain hash (xxh3) of the result: a step changes ~2% of BF16 values scattered over
//! every block, so hashing the result reads the whole model again on every engine: that pass cost
//! as much as the delta saved. This checksum is linear in its words,
//! `sum(T) = len * LEN_MIX + Σ_j term(j, w_j)` (mod 2^64), so a receiver that knows the sum of
//! its base gets the sum of the result from the words a delta rewrites: `+ term(j, new) -
//! term(j, old)` for each. It still covers every byte of the result:
//! - a receiver computes the sum of a tensor that comes whole from the bytes it received, as they
//!   arrive (still in cache), and updates it from the old and new words it actually holds;
//! - its engine cannot write to those bytes while it holds them (`TensorBytes` is read-only), so
//!   the words no delta touched are still the ones that were summed;
//! - so the sum it compares with the sender's (computed from scratch over the new version) is the
//!   sum of its own result, and a wrong base, a corrupted transfer (of this delta or of the
//!   version it applies to) or a wrong apply all show as a mismatch, and the tensor is resent.
//!
//! The term is UMAC's NH on the two 32-bit halves of a word, keyed by the word's position, plus
//! the word itself: `term(j, w) = (lo(w) + ka_j) * (hi(w) + kb_j) + w`, the additions mod 2^32,
//! the product exact in 64 bits. A change in one word goes unseen only when the product moves by
//! exactly minus the word's own change, which for a change within one half needs the other half
//! to sit at one value in 2^32; positions are keyed, so moved or swapped words show too; several
//! changed words collide only if their unrelated 64-bit differences sum to zero. It detects
//! accidents, as a CRC does; it is not a MAC against an adversary (neither is the transport). One
//! multiply per word, vectorized (`vpmuludq`): memory speed. The tests flip every bit of a
//! tensor, swap words, and corrupt 20,000 random sets of bytes.

/// Multiplier of the word position in the key (the 64-bit golden ratio, odd).
pub(crate) const KEY_STEP: u64 = 0x9E37_79B9_7F4A_7C15;

/// Multiplier of the tensor's byte length, so tensors of different lengths whose words match
/// (a zero-padded tail) do not collide.
const LEN_MIX: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// Word `j`'s term.
#[inline(always)]
pub(crate) fn term(j: u64, w: u64) -> u64 {
    let k = j.wrapping_add(1).wrapping_mul(KEY_STEP);
    let a = u64::from((w as u32).wrapping_add(k as u32));
    let b = u64::from(((w >> 32) as u32).wrapping_add((k >> 32) as u32));
    (a * b).wrapping_add(w)
}

/// Little-endian word of up to 8 bytes (a short tail is zero-padded).
#[inline(always)]
pub(crate) fn word(s: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..s.len()].copy_from_slice(s);
    u64::from_le_bytes(w)
}

/// The checksum of a whole tensor's bytes.
pub fn checksum(bytes: &[u8]) -> u64 {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 20;
    let body = if bytes.len() > 4 * PIECE {
        bytes
            .par_chunks(PIECE)
            .enumerate()
            .map(|(i, p)| words_sum((i * PIECE / 8) as u64, p))
            .reduce(|| 0, u64::wrapping_add)
    } else {
        words_sum(0, bytes)
    };
    finish(bytes.len(), body)
}

/// The checksum of a tensor of `len` bytes whose words sum to `body`.
pub(crate) fn finish(len: usize, body: u64) -> u64 {
    body.wrapping_add((len as u64).wrapping_mul(LEN_MIX))
}

/// Σ term over the words of `bytes`, the first being word `first` of its tensor; `bytes` starts
/// on a word boundary, and only a tensor's last piece may end off one (zero-padded).
pub(crate) fn words_sum(first: u64, bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2, the one feature the function is compiled for.
        return unsafe { words_sum_avx2(first, bytes) };
    }
    words_sum_portable(first, bytes)
}

/// [`words_sum`] in AVX2, four words per step: one 32-bit add of the keys, one shift, one
/// `vpmuludq`, two 64-bit adds. (LLVM's own vectorization of the portable loop rebuilt every
/// word from bytes with shuffles and ran at a third of this.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn words_sum_avx2(first: u64, bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let steps = bytes.len() / 32;
    let key = |i: u64| first.wrapping_add(1 + i).wrapping_mul(KEY_STEP) as i64;
    let mut k = _mm256_set_epi64x(key(3), key(2), key(1), key(0));
    let step = _mm256_set1_epi64x(KEY_STEP.wrapping_mul(4) as i64);
    let mut acc = _mm256_setzero_si256();
    for c in bytes[..steps * 32].chunks_exact(32) {
        // SAFETY: `c` holds exactly 32 readable bytes; the load is unaligned.
        let w = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
        let s = _mm256_add_epi32(w, k);
        let p = _mm256_mul_epu32(s, _mm256_srli_epi64::<32>(s));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(p, w));
        k = _mm256_add_epi64(k, step);
    }
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
    let head = lanes.iter().fold(0u64, |a, &l| a.wrapping_add(l));
    head.wrapping_add(words_sum_portable(
        first + 4 * steps as u64,
        &bytes[steps * 32..],
    ))
}

#[inline(always)]
fn words_sum_portable(first: u64, bytes: &[u8]) -> u64 {
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    let mut k = first.wrapping_add(1).wrapping_mul(KEY_STEP);
    let mut acc = 0u64;
    for c in words {
        let w = word(c);
        let a = u64::from((w as u32).wrapping_add(k as u32));
        let b = u64::from(((w >> 32) as u32).wrapping_add((k >> 32) as u32));
        acc = acc.wrapping_add(a * b).wrapping_add(w);
        k = k.wrapping_add(KEY_STEP);
    }
    if !tail.is_empty() {
        let j = first + (bytes.len() / 8) as u64;
        acc = acc.wrapping_add(term(j, word(tail)));
    }
    acc
}

/// The running checksum of a tensor arriving in pieces of any size: words are summed as soon as
/// they are complete (while they are still in cache).
#[derive(Debug, Default, Clone)]
pub(crate) struct Running {
    body: u64,
    /// Bytes summed so far (a multiple of 8 until the end).
    done: usize,
}

impl Running {
    /// Sums what `so_far` (the tensor's bytes received so far) adds since the last call.
    pub(crate) fn update(&mut self, so_far: &[u8]) {
        let end = so_far.len() & !7;
        if end > self.done {
            self.body = self
                .body
                .wrapping_add(words_sum((self.done / 8) as u64, &so_far[self.done..end]));
            self.done = end;
        }
    }

    /// The checksum once `all` (every byte of the tensor) is in.
    pub(crate) fn finish(mut self, all: &[u8]) -> u64 {
        self.update(all);
        if self.done < all.len() {
            let j = (self.done / 8) as u64;
            self.body = self.body.wrapping_add(term(j, word(&all[self.done..])));
        }
        finish(all.len(), self.body)
    }
}

/// `len` pseudo-random bytes from `seed`, for the tests of the delta code.
#[cfg(test)]
pub(crate) fn test_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (s >> 56) as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::test_bytes as data;
    use super::*;

    #[test]
    fn the_vector_loop_matches_the_definition_and_pieces_add_up() {
        for len in [0usize, 1, 7, 8, 9, 63, 64, 1000, 5 << 20] {
            let d = data(len, len as u64);
            let by_def = d.chunks(8).enumerate().fold(0u64, |acc, (j, c)| {
                acc.wrapping_add(term(j as u64, word(c)))
            });
            assert_eq!(checksum(&d), finish(len, by_def), "len {len}");
            let mut r = Running::default();
            for cut in [3usize, 17, 4096, 100_000] {
                r.update(&d[..cut.min(len)]);
            }
            assert_eq!(r.finish(&d), checksum(&d), "len {len}");
        }
    }

    #[test]
    fn every_single_bit_flip_and_word_swap_changes_it() {
        let d = data(4096 + 5, 3);
        let sum = checksum(&d);
        for i in 0..d.len() {
            for bit in 0..8 {
                let mut e = d.clone();
                e[i] ^= 1 << bit;
                assert_ne!(checksum(&e), sum, "byte {i} bit {bit}");
            }
        }
        let mut e = d.clone();
        e.copy_within(0..8, 16);
        e[..8].copy_from_slice(&d[16..24]);
        assert_ne!(checksum(&e), sum, "swapped words");
        // A changed length with equal words (a zero tail) is a different tensor.
        let mut z = d.clone();
        z.push(0);
        assert_ne!(checksum(&z), sum);
    }

    #[test]
    fn random_multi_word_corruptions_change_it() {
        let d = data(1 << 16, 9);
        let sum = checksum(&d);
        let mut s = 77u64;
        for _ in 0..20_000 {
            let mut e = d.clone();
            for _ in 0..1 + (s % 5) {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let at = (s >> 20) as usize % e.len();
                e[at] = e[at].wrapping_add(1 + (s >> 58) as u8);
            }
            assert_ne!(checksum(&e), sum);
        }
    }
}
