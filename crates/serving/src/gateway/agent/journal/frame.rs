//! The session log's framing: each record is `length (u32 LE) | CRC-32 (u32 LE) | payload`, so
//! a reader knows where a record ends, and a torn tail (a write cut by a crash) or flipped
//! bytes are found, never parsed. The CRC is the IEEE one (zlib's), computed here: 20 lines are
//! cheaper than a dependency.

use std::io::Read;

/// The largest record a reader accepts: a turn of a session at its default token cap
/// (1,048,576 tokens, about 8 bytes each as JSON ids and logprobs) fits with room; a length
/// past it is corruption, refused before anything is allocated for it.
pub(super) const MAX_RECORD: usize = 256 << 20;

const fn table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static TABLE: [u32; 256] = table();

/// CRC-32 (IEEE) of `b`.
pub(super) fn crc32(b: &[u8]) -> u32 {
    let mut c = !0u32;
    for &x in b {
        c = TABLE[((c ^ u32::from(x)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// `payload` framed.
pub(super) fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// What reading one record found.
#[derive(Debug)]
pub(super) enum Next {
    /// A whole record whose CRC holds.
    Record(Vec<u8>),
    /// The file ends here, between records.
    End,
    /// The file ends inside a record: a write cut short.
    Torn,
    /// A length past [`MAX_RECORD`] or a CRC that does not hold.
    Corrupt(String),
}

/// Reads the record at the reader's position.
pub(super) fn next(r: &mut impl Read) -> std::io::Result<Next> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..])? {
            0 if got == 0 => return Ok(Next::End),
            0 => return Ok(Next::Torn),
            n => got += n,
        }
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len > MAX_RECORD {
        return Ok(Next::Corrupt(format!(
            "a record length of {len} bytes, more than the {MAX_RECORD} a record may have"
        )));
    }
    let mut payload = Vec::new();
    let read = r.take(len as u64).read_to_end(&mut payload)?;
    if read < len {
        return Ok(Next::Torn);
    }
    if crc32(&payload) != crc {
        return Ok(Next::Corrupt(
            "a record whose checksum does not match its bytes".into(),
        ));
    }
    Ok(Next::Record(payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_damage_is_named() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926, "the IEEE check value");
        let mut bytes = frame(b"hello");
        bytes.extend(frame(b""));
        let mut r = &bytes[..];
        assert!(matches!(next(&mut r).unwrap(), Next::Record(p) if p == b"hello"));
        assert!(matches!(next(&mut r).unwrap(), Next::Record(p) if p.is_empty()));
        assert!(matches!(next(&mut r).unwrap(), Next::End));
        let torn = &frame(b"hello")[..10];
        assert!(matches!(next(&mut &torn[..]).unwrap(), Next::Torn));
        assert!(matches!(next(&mut &torn[..3]).unwrap(), Next::Torn));
        let mut flipped = frame(b"hello");
        flipped[9] ^= 1;
        assert!(matches!(next(&mut &flipped[..]).unwrap(), Next::Corrupt(_)));
        let huge = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];
        assert!(matches!(next(&mut &huge[..]).unwrap(), Next::Corrupt(m) if m.contains("length")));
    }
}
