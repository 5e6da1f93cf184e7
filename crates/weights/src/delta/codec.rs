//! The block encoding of one tensor against its base, the decoder that applies it in place,
//! and the checksum both ends compute on the result.
//!
//! A tensor's bytes are cut into [`BLOCK_BYTES`] blocks (the last may be shorter); each is
//! encoded as one of:
//! - `0` same: nothing follows;
//! - `1` sparse: `u32 count`, `count x u16` element indices within the block (ascending), then
//!   `count` element values (1, 2 or 4 bytes each, little-endian as on the wire);
//! - `2` XOR-zstd: `u32 len`, then `len` bytes of zstd-compressed `new ^ base` for the block;
//! - `3` whole: the block's bytes.
//!
//! Blocks are independent, so both ends work on them in parallel (rayon). The checksum of the
//! result ([`super::sum`]) is a sum over words: the sender computes it per block in the pass that
//! diffs the block, and a receiver updates the sum of its base from the words each block
//! rewrites.

use rayon::prelude::*;

use super::scan::{changed_indices, changed_indices_summed};
use super::sum::{self, term, word, words_sum};

/// Words per block.
const BLOCK_WORDS: u64 = (BLOCK_BYTES / 8) as u64;

/// Bytes per block: 64 KiB, so an element index within a block fits a `u16` for 1-byte (FP8)
/// elements, and a block's encoding is decided on data that is still in cache.
pub const BLOCK_BYTES: usize = 64 << 10;

const SAME: u8 = 0;
const SPARSE: u8 = 1;
const XOR_ZSTD: u8 = 2;
const WHOLE: u8 = 3;

/// Blocks encoded per parallel wave; after the first wave a tensor that does not pay is
/// abandoned (sent whole) instead of being diffed to the end.
const WAVE_BLOCKS: usize = 64;

/// Most changed elements a block of `len` bytes goes sparse with: one per 16 bytes. Each pair
/// costs ~10 ns on each end (find it, write it, update the checksum), so past this a block is
/// cheaper to send whole at a few GB/s than to patch (measured: FP8 with 8% of bytes changed
/// went 3x slower as pairs than whole over loopback); the pairs are also at most
/// `(2 + 4) / 16` of the block, so a sparse block always saves bytes.
fn sparse_limit(len: usize) -> usize {
    len / 16
}

/// Bytes counted (not encoded) before anything else, to give up at once on a tensor that
/// changed nearly everywhere.
const GLANCE_BYTES: usize = 8 << 10;

/// Blocks diffed before the rest, to give up early on a tensor that changed nearly everywhere.
const PROBE_BLOCKS: usize = 2;

/// A delta is sent only when it is at most this fraction of the tensor's bytes; above it the
/// receiver's decode costs more than the bytes saved.
const WORTH: f64 = 0.9;

/// zstd level for XOR blocks: level 1 compresses XORed BF16 best per CPU second (measured:
/// negative levels lose a third of the ratio for ~10% speed).
const ZSTD_LEVEL: i32 = 1;

/// One tensor's delta: the encoded bytes, the checksum of the result, and how many elements
/// differed from the base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The block stream.
    pub bytes: Vec<u8>,
    /// [`checksum`] of the new tensor.
    pub checksum: u64,
    /// Elements that differ from the base.
    pub changed: u64,
}

/// The checksum of a tensor's bytes ([`super::sum`]).
pub fn checksum(bytes: &[u8]) -> u64 {
    sum::checksum(bytes)
}

/// A tensor whose delta would not pay: how many elements were compared before giving up, and
/// how many of those had changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dense {
    /// Elements compared.
    pub compared: u64,
    /// Of those, the ones that differed.
    pub changed: u64,
}

/// A block of the base as the encoder sees it: updated in place to equal the new bytes
/// (the sender owns its copy), or only read (the sender will keep the caller's new buffer).
trait BaseBlock: Send {
    fn bytes(&self) -> &[u8];
    fn set(&mut self, at: usize, src: &[u8]);
}

impl BaseBlock for &[u8] {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn set(&mut self, _: usize, _: &[u8]) {}
}

impl BaseBlock for &mut [u8] {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn set(&mut self, at: usize, src: &[u8]) {
        self[at..at + src.len()].copy_from_slice(src);
    }
}

fn valid(base: &[u8], new: &[u8], elem: usize) -> bool {
    base.len() == new.len() && matches!(elem, 1 | 2 | 4) && new.len().is_multiple_of(elem)
}

/// Encodes `new` against `base` (same length, `elem`-byte elements) and makes `base` equal to
/// `new` on the way. Fails with [`Dense`] when the delta would not be clearly smaller than
/// `new` (then `base` may hold a mix: the caller sends `new` whole and copies it into `base`).
pub fn encode(base: &mut [u8], new: &[u8], elem: usize, compress: bool) -> Result<Encoded, Dense> {
    if !valid(base, new, elem) {
        return Err(Dense::default());
    }
    encode_blocks(base.chunks_mut(BLOCK_BYTES).collect(), new, elem, compress)
}

/// [`encode`] without touching `base`: for a sender that keeps `new` itself as the next base
/// (it reads the two versions and writes nothing but the delta).
pub fn encode_against(
    base: &[u8],
    new: &[u8],
    elem: usize,
    compress: bool,
) -> Result<Encoded, Dense> {
    if !valid(base, new, elem) {
        return Err(Dense::default());
    }
    encode_blocks(base.chunks(BLOCK_BYTES).collect(), new, elem, compress)
}

fn encode_blocks<B: BaseBlock>(
    mut base: Vec<B>,
    new: &[u8],
    elem: usize,
    compress: bool,
) -> Result<Encoded, Dense> {
    // A glance first (a count, nothing built): a tensor that changed nearly everywhere is sent
    // whole after reading a few KiB of it (unless compressing, which may still pay on it).
    let glance = GLANCE_BYTES.min(new.len());
    if !compress && glance >= 64 {
        let (b, n) = (&base[0].bytes()[..glance], &new[..glance]);
        let changed = changed_indices(b, n, elem, 0, &mut Vec::with_capacity(8));
        if changed > sparse_limit(glance) {
            return Err(Dense {
                compared: (glance / elem) as u64,
                changed: changed as u64,
            });
        }
    }
    let news: Vec<&[u8]> = new.chunks(BLOCK_BYTES).collect();
    let mut bytes = Vec::new();
    let mut body = 0u64;
    let mut changed = 0u64;
    // A probe of the first blocks first: a tensor that changed nearly everywhere is sent whole
    // after diffing a few blocks, not all of it.
    let (mut start, mut wave, mut seen) = (0usize, PROBE_BLOCKS, 0usize);
    while start < news.len() {
        let end = (start + wave).min(news.len());
        let one = |(k, (b, n)): (usize, (&mut B, &&[u8]))| {
            let mut out = Vec::new();
            let (c, sum) = encode_block(b, n, elem, compress, &mut out, k as u64 * BLOCK_WORDS);
            (out, sum, c)
        };
        // A probe's two blocks are not worth waking the pool for.
        let encoded: Vec<(Vec<u8>, u64, u64)> = if end - start <= PROBE_BLOCKS {
            base[start..end]
                .iter_mut()
                .zip(news[start..end].iter())
                .enumerate()
                .map(|(i, p)| one((start + i, p)))
                .collect()
        } else {
            base[start..end]
                .par_iter_mut()
                .zip(news[start..end].par_iter())
                .enumerate()
                .map(|(i, p)| one((start + i, p)))
                .collect()
        };
        // A block left empty goes whole: its bytes are copied once, here, and only if the
        // tensor still pays.
        let size = |(e, n): (&Vec<u8>, &&[u8])| if e.is_empty() { 1 + n.len() } else { e.len() };
        let wave_len: usize = encoded
            .iter()
            .map(|e| &e.0)
            .zip(&news[start..end])
            .map(size)
            .sum();
        seen += news[start..end].iter().map(|n| n.len()).sum::<usize>();
        if (bytes.len() + wave_len) as f64 > WORTH * seen as f64 {
            let more: u64 = encoded.iter().map(|e| e.2).sum();
            return Err(Dense {
                compared: (seen / elem) as u64,
                changed: changed + more,
            });
        }
        bytes.reserve(wave_len);
        for ((e, h, c), n) in encoded.into_iter().zip(&news[start..end]) {
            if e.is_empty() {
                bytes.push(WHOLE);
                bytes.extend_from_slice(n);
            } else {
                bytes.extend_from_slice(&e);
            }
            body = body.wrapping_add(h);
            changed += c;
        }
        (start, wave) = (end, WAVE_BLOCKS);
    }
    Ok(Encoded {
        bytes,
        checksum: sum::finish(new.len(), body),
        changed,
    })
}

/// Encodes one block into `out` (left empty when the block goes whole: the caller copies it)
/// and makes `base` equal to `new`; returns how many elements differ and the checksum's sum
/// over `new`'s words (its first is word `first` of the tensor).
fn encode_block<B: BaseBlock>(
    base: &mut B,
    new: &[u8],
    elem: usize,
    compress: bool,
    out: &mut Vec<u8>,
    first: u64,
) -> (u64, u64) {
    // Beyond this many changed elements the block goes whole, and the indices are not
    // collected past it (a dense block costs one quick pass).
    let limit = sparse_limit(new.len());
    let mut idx: Vec<u16> = Vec::with_capacity(limit + 8);
    let (count, sum) = changed_indices_summed(base.bytes(), new, elem, limit, &mut idx, first);
    if count == 0 {
        out.push(SAME);
        return (0, sum);
    }
    let sparse_len = 5 + count * (2 + elem);
    let whole_len = 1 + new.len();
    let mut best = if count <= limit {
        sparse_len.min(whole_len)
    } else {
        whole_len
    };
    let mut xz = None;
    // Below 1/16 of the block the pairs are within a few bytes of any compressed form, and
    // the compressor would cost more than the block takes to send.
    if compress && sparse_len > new.len() / 16 {
        let x: Vec<u8> = base.bytes().iter().zip(new).map(|(a, b)| a ^ b).collect();
        if let Ok(z) = zstd::bulk::compress(&x, ZSTD_LEVEL)
            && 5 + z.len() < best
        {
            best = 5 + z.len();
            xz = Some(z);
        }
    }
    if let Some(z) = xz {
        out.push(XOR_ZSTD);
        out.extend_from_slice(&(z.len() as u32).to_le_bytes());
        out.extend_from_slice(&z);
        base.set(0, new);
    } else if best == sparse_len {
        let start = out.len();
        out.resize(start + sparse_len, 0);
        let o = &mut out[start..];
        o[0] = SPARSE;
        o[1..5].copy_from_slice(&(count as u32).to_le_bytes());
        let (ix, vals) = o[5..].split_at_mut(2 * count);
        for (d, i) in ix.chunks_exact_mut(2).zip(&idx) {
            d.copy_from_slice(&i.to_le_bytes());
        }
        for (d, &i) in vals.chunks_exact_mut(elem).zip(&idx) {
            let at = usize::from(i) * elem;
            d.copy_from_slice(&new[at..at + elem]);
            base.set(at, &new[at..at + elem]);
        }
    } else {
        base.set(0, new);
    }
    (count as u64, sum)
}

/// Applies the block stream `enc` to `base` in place (`elem`-byte elements) and returns the
/// [`checksum`] of the result, given `base_sum`, the checksum of `base` as the caller holds it
/// (only the words the delta rewrites are read). An error names what was malformed; `base` is
/// then partly updated and must not be used.
pub fn apply(base: &mut [u8], enc: &[u8], elem: usize, base_sum: u64) -> Result<u64, String> {
    if !matches!(elem, 1 | 2 | 4) {
        return Err(format!("element size {elem}"));
    }
    let blocks = base.len().div_ceil(BLOCK_BYTES);
    // Find every block's encoding first (each one's length is in its header).
    let mut parts = Vec::with_capacity(blocks);
    let mut at = 0usize;
    for k in 0..blocks {
        let len = BLOCK_BYTES.min(base.len() - k * BLOCK_BYTES);
        let kind = *enc
            .get(at)
            .ok_or_else(|| format!("delta ends at block {k} of {blocks}"))?;
        let body = match kind {
            SAME => 0,
            SPARSE => {
                let count = read_u32(enc, at + 1)? as usize;
                if count > len / elem {
                    return Err(format!("block {k}: {count} sparse entries"));
                }
                4 + count * (2 + elem)
            }
            XOR_ZSTD => 4 + read_u32(enc, at + 1)? as usize,
            WHOLE => len,
            other => return Err(format!("block {k}: unknown kind {other}")),
        };
        let end = at + 1 + body;
        if end > enc.len() {
            return Err(format!("block {k} runs past the end of the delta"));
        }
        parts.push(&enc[at..end]);
        at = end;
    }
    if at != enc.len() {
        return Err(format!("{} bytes after the last block", enc.len() - at));
    }
    let change = base
        .par_chunks_mut(BLOCK_BYTES)
        .zip(parts.par_iter())
        .enumerate()
        .map(|(k, (b, p))| {
            apply_block(b, p, elem, k as u64 * BLOCK_WORDS).map_err(|e| format!("block {k}: {e}"))
        })
        .try_reduce(|| 0, |x, y| Ok(x.wrapping_add(y)))?;
    Ok(base_sum.wrapping_add(change))
}

/// Applies one block's encoding; returns how the checksum's sum changed (the block's first word
/// is word `first` of the tensor).
fn apply_block(b: &mut [u8], part: &[u8], elem: usize, first: u64) -> Result<u64, String> {
    let body = &part[1..];
    let whole_before = match part[0] {
        SAME => return Ok(0),
        SPARSE => None,
        _ => Some(words_sum(first, b)),
    };
    match part[0] {
        SPARSE => {
            let count = read_u32(body, 0)? as usize;
            let (idx, vals) = body[4..].split_at(2 * count);
            return match elem {
                1 => apply_sparse::<1>(b, idx, vals, first),
                2 => apply_sparse::<2>(b, idx, vals, first),
                _ => apply_sparse::<4>(b, idx, vals, first),
            };
        }
        XOR_ZSTD => {
            let x =
                zstd::bulk::decompress(&body[4..], b.len()).map_err(|e| format!("zstd: {e}"))?;
            if x.len() != b.len() {
                return Err(format!(
                    "XOR of {} bytes for a {}-byte block",
                    x.len(),
                    b.len()
                ));
            }
            for (d, x) in b.iter_mut().zip(&x) {
                *d ^= x;
            }
        }
        _ => b.copy_from_slice(body),
    }
    let before = whole_before.unwrap_or(0);
    Ok(words_sum(first, b).wrapping_sub(before))
}

/// Writes sparse `(index, value)` pairs of `ELEM`-byte elements into block `b` and returns how
/// the checksum's sum changed: each rewritten word adds `term(new) - term(old)`. A word is
/// read once, patched in a register by every entry that falls in it (in a valid delta they are
/// ascending, so they come together), and written once, so no load waits on a narrower store
/// to the same word. What made the loop 2-3x faster was the prefetch: its old-word loads miss
/// (about half the model's lines), and without it they ran nearly one at a time. A word met
/// again later adds its next change, so any order sums right.
fn apply_sparse<const ELEM: usize>(
    b: &mut [u8],
    idx: &[u8],
    vals: &[u8],
    first: u64,
) -> Result<u64, String> {
    let lane: u64 = (1u64 << (8 * ELEM)) - 1;
    let mut change = 0u64;
    // The word being rewritten: its index, its old value and its value so far.
    let mut cur: Option<(usize, u64, u64)> = None;
    for (k, (i, v)) in idx.chunks_exact(2).zip(vals.chunks_exact(ELEM)).enumerate() {
        if let Some(p) = idx.get(2 * (k + PREFETCH_AHEAD)..2 * (k + PREFETCH_AHEAD) + 2) {
            prefetch(b, usize::from(u16::from_le_bytes([p[0], p[1]])) * ELEM);
        }
        let at = usize::from(u16::from_le_bytes([i[0], i[1]])) * ELEM;
        if at + ELEM > b.len() {
            return Err(format!("element {} outside the block", at / ELEM));
        }
        let (wi, shift) = (at / 8, 8 * (at % 8));
        let mut lanes = [0u8; 8];
        lanes[..ELEM].copy_from_slice(v);
        let val = u64::from_le_bytes(lanes) << shift;
        let keep = !(lane << shift);
        cur = Some(match cur {
            Some((w, old, new)) if w == wi => (w, old, (new & keep) | val),
            prev => {
                if let Some((w, old, new)) = prev {
                    change = change.wrapping_add(put_word(b, w, first, old, new));
                }
                let old = match b.get(8 * wi..8 * wi + 8) {
                    Some(w) => u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]),
                    None => word(&b[8 * wi..]),
                };
                (wi, old, (old & keep) | val)
            }
        });
    }
    if let Some((w, old, new)) = cur {
        change = change.wrapping_add(put_word(b, w, first, old, new));
    }
    Ok(change)
}

/// How many entries ahead [`apply_sparse`] asks for the cache line it will patch: its loads
/// miss (a 2% step touches every other line of the model), and the loop alone keeps too few
/// of them in flight.
const PREFETCH_AHEAD: usize = 16;

/// Asks the CPU to bring the line holding `b[at]` into the cache (nothing when `at` is out of
/// `b` or on other CPUs).
#[inline(always)]
fn prefetch(b: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < b.len() {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch reads nothing architecturally; the address is inside `b` anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().add(at).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (b, at);
}

/// Stores word `w` of block `b` (a block's last word may be short) and returns its checksum
/// change.
#[inline(always)]
fn put_word(b: &mut [u8], w: usize, first: u64, old: u64, new: u64) -> u64 {
    match b.get_mut(8 * w..8 * w + 8) {
        Some(d) => d.copy_from_slice(&new.to_le_bytes()),
        None => {
            let tail = &mut b[8 * w..];
            let n = tail.len();
            tail.copy_from_slice(&new.to_le_bytes()[..n]);
        }
    }
    let j = first + w as u64;
    term(j, new).wrapping_sub(term(j, old))
}

fn read_u32(buf: &[u8], at: usize) -> Result<u32, String> {
    buf.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| "truncated block header".to_string())
}

/// Most bytes a valid delta of a `len`-byte tensor can take (every block whole), so a
/// receiver can refuse a larger claim before allocating for it.
pub fn max_encoded_len(len: usize) -> usize {
    len + len.div_ceil(BLOCK_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(base: &[u8], frac: f64, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut out = base.to_vec();
        for e in out.chunks_exact_mut(2) {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            if ((s >> 11) as f64 / (1u64 << 53) as f64) < frac {
                let v = u16::from_le_bytes([e[0], e[1]]).wrapping_add(1);
                e.copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn every_mode_round_trips_bit_exactly() {
        let len = 3 * BLOCK_BYTES + 1234;
        let base: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        for (frac, compress) in [(0.0, false), (0.02, false), (0.3, true), (0.02, true)] {
            let new = step(&base, frac, 9);
            let mut sender = base.clone();
            let enc = encode(&mut sender, &new, 2, compress).expect("pays");
            assert_eq!(sender, new, "the sender's base follows");
            assert_eq!(encode_against(&base, &new, 2, compress), Ok(enc.clone()));
            assert_eq!(enc.checksum, checksum(&new));
            let mut rx = base.clone();
            assert_eq!(
                apply(&mut rx, &enc.bytes, 2, checksum(&base)).unwrap(),
                checksum(&new)
            );
            assert_eq!(rx, new, "frac {frac} compress {compress}");
        }
        // Dense changes do not pay: the caller sends the tensor whole.
        let new = step(&base, 1.0, 3);
        assert!(encode(&mut base.clone(), &new, 2, false).is_err());
    }

    #[test]
    fn fp8_and_f32_elements_and_an_odd_tail() {
        for elem in [1usize, 4] {
            let len = BLOCK_BYTES + 12 * elem;
            let base: Vec<u8> = (0..len).map(|i| (i % 13) as u8).collect();
            let mut new = base.clone();
            new[5] ^= 1;
            new[len - 1] ^= 0x80;
            let enc = encode(&mut base.clone(), &new, elem, false).unwrap();
            assert_eq!(enc.changed, 2);
            let mut rx = base.clone();
            let sum = apply(&mut rx, &enc.bytes, elem, checksum(&base)).unwrap();
            assert_eq!(sum, checksum(&new));
            assert_eq!(rx, new);
        }
    }

    #[test]
    fn malformed_deltas_are_refused_not_applied_past_the_block() {
        let base = vec![0u8; 2 * BLOCK_BYTES];
        let mut new = base.clone();
        new[10] = 1;
        let enc = encode(&mut base.clone(), &new, 2, false).unwrap().bytes;
        for cut in [0, 1, enc.len() - 1] {
            assert!(
                apply(&mut base.clone(), &enc[..cut], 2, 0).is_err(),
                "cut {cut}"
            );
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert!(apply(&mut base.clone(), &extra, 2, 0).is_err());
        let mut bad_kind = enc.clone();
        bad_kind[0] = 9;
        assert!(
            apply(&mut base.clone(), &bad_kind, 2, 0)
                .unwrap_err()
                .contains("kind 9")
        );
        // A flipped value byte still decodes, but the checksum differs: the caller resends.
        let mut flipped = enc.clone();
        // Block 0 is sparse: kind, count, one index, then the value at byte 7.
        assert_eq!(flipped[0], SPARSE);
        flipped[7] ^= 0xFF;
        let mut rx = base.clone();
        assert_ne!(
            apply(&mut rx, &flipped, 2, checksum(&base)).unwrap(),
            checksum(&new)
        );
        // So does a base that is not what the sender diffed against, even where the delta
        // does not write.
        let mut other = base.clone();
        other[BLOCK_BYTES + 3] ^= 4;
        let sum = checksum(&other);
        assert_ne!(apply(&mut other, &enc, 2, sum).unwrap(), checksum(&new));
    }
}
