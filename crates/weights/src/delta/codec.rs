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
//! Blocks are independent, so both ends work on them in parallel (rayon). The checksum of a
//! tensor is xxh3-64 over its length and the xxh3-64 of every block, so it too is computed per
//! block, in the same pass that encodes or applies the block (the block is still in cache).

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

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

/// The checksum of a tensor's bytes (xxh3-64 over its length and its blocks' xxh3-64s).
pub fn checksum(bytes: &[u8]) -> u64 {
    let hashes: Vec<u64> = if bytes.len() > 4 * BLOCK_BYTES {
        bytes.par_chunks(BLOCK_BYTES).map(xxh3_64).collect()
    } else {
        bytes.chunks(BLOCK_BYTES).map(xxh3_64).collect()
    };
    combine(bytes.len(), &hashes)
}

fn combine(len: usize, block_hashes: &[u64]) -> u64 {
    let mut buf = Vec::with_capacity(8 + 8 * block_hashes.len());
    buf.extend_from_slice(&(len as u64).to_le_bytes());
    for h in block_hashes {
        buf.extend_from_slice(&h.to_le_bytes());
    }
    xxh3_64(&buf)
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

/// Encodes `new` against `base` (same length, `elem`-byte elements) and makes `base` equal to
/// `new` on the way. Fails with [`Dense`] when the delta would not be clearly smaller than
/// `new` (then `base` may hold a mix: the caller sends `new` whole and copies it into `base`).
pub fn encode(base: &mut [u8], new: &[u8], elem: usize, compress: bool) -> Result<Encoded, Dense> {
    if base.len() != new.len() || !matches!(elem, 1 | 2 | 4) || !new.len().is_multiple_of(elem) {
        return Err(Dense::default());
    }
    let blocks = new.len().div_ceil(BLOCK_BYTES);
    let mut bytes = Vec::new();
    let mut hashes = Vec::with_capacity(blocks);
    let mut changed = 0u64;
    // A probe of the first blocks first: a tensor that changed nearly everywhere is sent whole
    // after diffing a few blocks, not all of it.
    let probe = (PROBE_BLOCKS * BLOCK_BYTES).min(new.len());
    let (b0, b1) = base.split_at_mut(probe);
    let (n0, n1) = new.split_at(probe);
    let wave = WAVE_BLOCKS * BLOCK_BYTES;
    let waves = std::iter::once((b0, n0)).chain(b1.chunks_mut(wave).zip(n1.chunks(wave)));
    let mut seen = 0usize;
    for (b, n) in waves {
        let encoded: Vec<(Vec<u8>, u64, u64)> = b
            .par_chunks_mut(BLOCK_BYTES)
            .zip(n.par_chunks(BLOCK_BYTES))
            .map(|(b, n)| {
                let mut out = Vec::new();
                let c = encode_block(b, n, elem, compress, &mut out);
                (out, xxh3_64(n), c)
            })
            .collect();
        for (e, h, c) in encoded {
            bytes.extend_from_slice(&e);
            hashes.push(h);
            changed += c;
        }
        seen += n.len();
        if bytes.len() as f64 > WORTH * seen as f64 {
            return Err(Dense {
                compared: (seen / elem) as u64,
                changed,
            });
        }
    }
    Ok(Encoded {
        bytes,
        checksum: combine(new.len(), &hashes),
        changed,
    })
}

/// Encodes one block into `out` and makes `base` equal to `new`; returns how many elements
/// differ.
fn encode_block(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    compress: bool,
    out: &mut Vec<u8>,
) -> u64 {
    let mut idx: Vec<u16> = Vec::new();
    changed_indices(base, new, elem, &mut idx);
    let count = idx.len();
    if count == 0 {
        out.push(SAME);
        return 0;
    }
    let sparse_len = 5 + count * (2 + elem);
    let whole_len = 1 + new.len();
    let mut best = sparse_len.min(whole_len);
    let mut xz = None;
    // Below 1/16 of the block the pairs are within a few bytes of any compressed form, and
    // the compressor would cost more than the block takes to send.
    if compress && sparse_len > new.len() / 16 {
        let x: Vec<u8> = base.iter().zip(new).map(|(a, b)| a ^ b).collect();
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
        base.copy_from_slice(new);
    } else if best == sparse_len {
        out.reserve(sparse_len);
        out.push(SPARSE);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        for i in &idx {
            out.extend_from_slice(&i.to_le_bytes());
        }
        for &i in &idx {
            let at = usize::from(i) * elem;
            out.extend_from_slice(&new[at..at + elem]);
            base[at..at + elem].copy_from_slice(&new[at..at + elem]);
        }
    } else {
        out.push(WHOLE);
        out.extend_from_slice(new);
        base.copy_from_slice(new);
    }
    count as u64
}

/// Pushes the index of every `elem`-byte element where `a` and `b` differ. Runs of 64 bytes
/// are checked first with one vectorizable XOR-OR (most runs are equal in a sparse step),
/// then words of eight bytes.
fn changed_indices(a: &[u8], b: &[u8], elem: usize, idx: &mut Vec<u16>) {
    const RUN: usize = 64;
    let per_word = 8 / elem;
    let mask: u64 = if elem == 4 {
        0xFFFF_FFFF
    } else {
        (1u64 << (8 * elem)) - 1
    };
    let word = |s: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        u64::from_le_bytes(w)
    };
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
            let first = (r * RUN + 8 * k) / elem;
            for e in 0..per_word {
                if (d >> (8 * elem * e)) & mask != 0 {
                    idx.push((first + e) as u16);
                }
            }
        }
    }
    for e in (runs * RUN / elem)..(a.len() / elem) {
        if a[e * elem..(e + 1) * elem] != b[e * elem..(e + 1) * elem] {
            idx.push(e as u16);
        }
    }
}

/// Applies the block stream `enc` to `base` in place (`elem`-byte elements) and returns the
/// [`checksum`] of the result. An error names what was malformed; `base` is then partly
/// updated and must not be used.
pub fn apply(base: &mut [u8], enc: &[u8], elem: usize) -> Result<u64, String> {
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
    let hashes = base
        .par_chunks_mut(BLOCK_BYTES)
        .zip(parts.par_iter())
        .enumerate()
        .map(|(k, (b, p))| apply_block(b, p, elem).map_err(|e| format!("block {k}: {e}")))
        .collect::<Result<Vec<u64>, String>>()?;
    Ok(combine(base.len(), &hashes))
}

fn apply_block(b: &mut [u8], part: &[u8], elem: usize) -> Result<u64, String> {
    let body = &part[1..];
    match part[0] {
        SAME => {}
        SPARSE => {
            let count = read_u32(body, 0)? as usize;
            let (idx, vals) = body[4..].split_at(2 * count);
            for (i, v) in idx.chunks_exact(2).zip(vals.chunks_exact(elem)) {
                let at = usize::from(u16::from_le_bytes([i[0], i[1]])) * elem;
                b.get_mut(at..at + elem)
                    .ok_or_else(|| format!("element {} outside the block", at / elem))?
                    .copy_from_slice(v);
            }
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
    Ok(xxh3_64(b))
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
            assert_eq!(enc.checksum, checksum(&new));
            let mut rx = base.clone();
            assert_eq!(apply(&mut rx, &enc.bytes, 2).unwrap(), checksum(&new));
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
            apply(&mut rx, &enc.bytes, elem).unwrap();
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
                apply(&mut base.clone(), &enc[..cut], 2).is_err(),
                "cut {cut}"
            );
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert!(apply(&mut base.clone(), &extra, 2).is_err());
        let mut bad_kind = enc.clone();
        bad_kind[0] = 9;
        assert!(
            apply(&mut base.clone(), &bad_kind, 2)
                .unwrap_err()
                .contains("kind 9")
        );
        // A flipped value byte still decodes, but the checksum differs: the caller resends.
        let mut flipped = enc.clone();
        // Block 0 is sparse: kind, count, one index, then the value at byte 7.
        assert_eq!(flipped[0], SPARSE);
        flipped[7] ^= 0xFF;
        let mut rx = base.clone();
        assert_ne!(apply(&mut rx, &flipped, 2).unwrap(), checksum(&new));
    }
}
