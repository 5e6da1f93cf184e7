//! Incremental decoding of a bucket from arbitrary chunks of the data stream, checking every
//! header against what the engine was told to expect *before* allocating for its payload.

use super::apply::{self, Work};
use super::frame::expected_len;
use super::{
    FRAME_BUCKET_END, FRAME_DELTA, FRAME_TENSOR, FRAME_WHOLE_TAGGED, MAX_NDIM, MAX_TENSOR_BYTES,
    OwnedTensor, TensorBytes, TensorSpec, WireDtype,
};
use crate::delta::SharedReceiverBases;
use crate::delta::codec::max_encoded_len;
use crate::delta::sum::Running;

/// A delta frame read in full, being applied to the receiver's base since its frame completed.
#[derive(Debug)]
pub(crate) struct PendingDelta {
    /// Position of the tensor in the bucket.
    pub(crate) index: usize,
    /// Checksum of the result (its tag afterwards).
    pub(crate) result: u64,
    /// Its apply.
    pub(crate) work: Work,
}

/// What a bucket's frames said beyond the tensors: tags of whole tensors, deltas to apply, and
/// which tensors came in the untagged (delta-off) form.
#[derive(Debug, Default)]
pub(crate) struct Frames {
    /// Whole tensors kept as bases: position, tag, and the checksum of the bytes received.
    pub(crate) tagged: Vec<(usize, u64, u64)>,
    pub(crate) deltas: Vec<PendingDelta>,
    pub(crate) untagged: Vec<usize>,
}

/// Header words after `byte_len` for each tensor frame kind.
fn extra_words(kind: u8) -> usize {
    match kind {
        FRAME_WHOLE_TAGGED => 1,
        FRAME_DELTA => 3,
        _ => 0,
    }
}

/// What the decoder is waiting for.
#[derive(Debug)]
enum Stage {
    /// A frame kind byte.
    Kind,
    /// `u16` name length.
    NameLen,
    /// Name bytes, dtype byte, ndim byte.
    Name { name_len: usize },
    /// `ndim` dims and `byte_len`.
    Dims {
        name: String,
        dtype: WireDtype,
        ndim: usize,
    },
    /// Payload bytes of the tensor being filled.
    Payload { remaining: usize },
    /// `u32` tensor count of the end frame.
    Count,
    /// The end frame was read and matched.
    Done,
}

/// Turns the bytes of one bucket, fed in any chunking, into [`OwnedTensor`]s.
#[derive(Debug)]
pub(crate) struct Assembler<'a> {
    expected: &'a [TensorSpec],
    out: Vec<OwnedTensor>,
    current: Option<OwnedTensor>,
    stage: Stage,
    pending: Vec<u8>,
    /// Buffers of earlier tensors to fill instead of allocating (see
    /// [`WeightReceiver::recycle`](super::WeightReceiver::recycle)).
    spare: Vec<Vec<u8>>,
    /// Kind of the tensor frame being decoded.
    kind: u8,
    /// The current delta frame's `(base_tag, result)`.
    delta: Option<(u64, u64)>,
    /// The current tagged whole tensor's checksum so far (summed as its bytes arrive).
    running: Option<(u64, Running)>,
    frames: Frames,
    /// The receiver's delta bases: a delta is applied to the one it names as soon as its
    /// frame is in, and a tensor that comes whole is read into its old base's buffer (that
    /// base is replaced anyway), so a sync that sends tensors whole allocates nothing.
    bases: SharedReceiverBases,
}

impl<'a> Assembler<'a> {
    #[cfg(test)]
    pub(crate) fn new(expected: &'a [TensorSpec]) -> Self {
        Self::with_spare(expected, Vec::new(), SharedReceiverBases::default())
    }

    /// A decoder that applies deltas to `bases` and fills, for each tensor that comes whole,
    /// its old base's buffer, else the best-fitting buffer of `spare` (the smallest whose
    /// capacity holds it), and allocates only when none fits.
    pub(crate) fn with_spare(
        expected: &'a [TensorSpec],
        spare: Vec<Vec<u8>>,
        bases: SharedReceiverBases,
    ) -> Self {
        Self {
            expected,
            out: Vec::with_capacity(expected.len()),
            current: None,
            stage: Stage::Kind,
            pending: Vec::with_capacity(64),
            spare,
            kind: FRAME_TENSOR,
            delta: None,
            running: None,
            frames: Frames::default(),
            bases,
        }
    }

    /// What the frames said about tags and deltas (taken once the bucket is done).
    pub(crate) fn take_frames(&mut self) -> Frames {
        std::mem::take(&mut self.frames)
    }

    /// The spare buffers no tensor of this bucket used.
    pub(crate) fn take_spare(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.spare)
    }

    /// While the decoder is inside a tensor's payload: that tensor's buffer and how many bytes
    /// it still wants. The caller appends at most that many, then says how many with
    /// [`filled`](Self::filled), so payload is read straight into place instead of copied.
    pub(crate) fn payload_room(&mut self) -> Option<(&mut Vec<u8>, usize)> {
        match (&self.stage, self.current.as_mut()) {
            (Stage::Payload { remaining }, Some(t)) => Some((&mut t.bytes.0, *remaining)),
            _ => None,
        }
    }

    /// Records that `n` payload bytes were appended to the buffer of
    /// [`payload_room`](Self::payload_room).
    pub(crate) fn filled(&mut self, n: usize) {
        if let Stage::Payload { remaining } = &mut self.stage {
            *remaining -= n.min(*remaining);
            let done = *remaining == 0;
            self.sum_arrived();
            if done {
                self.finish_tensor();
            }
        }
    }

    /// Bytes still needed to complete the header piece being decoded (at least 1), so a
    /// reader can take headers without reading into the payload that follows.
    pub(crate) fn header_want(&self) -> usize {
        self.want().saturating_sub(self.pending.len()).max(1)
    }

    /// An empty buffer with room for `len` bytes for tensor `name`, which comes whole: its old
    /// base's buffer, else the best-fitting spare, else a new one.
    fn buffer_for(&mut self, name: &str, len: usize) -> Vec<u8> {
        let old = self
            .bases
            .lock()
            .ok()
            .and_then(|mut b| b.take_any(name, len));
        match old {
            Some(mut b) => {
                b.clear();
                b
            }
            None => self.buffer(len),
        }
    }

    /// An empty buffer with room for `len` bytes: the best-fitting spare, or a new one.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let fit = self
            .spare
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match fit {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Whether the whole bucket, end frame included, has been decoded.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Done)
    }

    /// The decoded tensors; only meaningful once [`is_done`](Self::is_done).
    pub(crate) fn into_tensors(self) -> Vec<OwnedTensor> {
        self.out
    }

    fn want(&self) -> usize {
        match &self.stage {
            Stage::Kind => 1,
            Stage::NameLen => 2,
            Stage::Name { name_len } => name_len + 2,
            Stage::Dims { ndim, .. } => ndim * 8 + 8 + 8 * extra_words(self.kind),
            Stage::Count => 4,
            Stage::Payload { .. } | Stage::Done => 0,
        }
    }

    /// Consumes `input`; an error describes the first byte that does not match expectations.
    pub(crate) fn feed(&mut self, mut input: &[u8]) -> Result<(), String> {
        while !input.is_empty() {
            match &mut self.stage {
                Stage::Done => {
                    return Err(format!("{} bytes after the end of the bucket", input.len()));
                }
                Stage::Payload { remaining } => {
                    let take = (*remaining).min(input.len());
                    if let Some(t) = self.current.as_mut() {
                        t.bytes.0.extend_from_slice(&input[..take]);
                    }
                    *remaining -= take;
                    let done = *remaining == 0;
                    input = &input[take..];
                    self.sum_arrived();
                    if done {
                        self.finish_tensor();
                    }
                }
                _ => {
                    let want = self.want();
                    let take = (want - self.pending.len()).min(input.len());
                    self.pending.extend_from_slice(&input[..take]);
                    input = &input[take..];
                    if self.pending.len() == want {
                        let header = std::mem::take(&mut self.pending);
                        self.advance(&header)?;
                        self.pending = header;
                        self.pending.clear();
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds the payload bytes that just arrived to the running checksum of a tagged tensor.
    fn sum_arrived(&mut self) {
        if let (Some((_, r)), Some(t)) = (self.running.as_mut(), self.current.as_ref()) {
            r.update(&t.bytes);
        }
    }

    fn finish_tensor(&mut self) {
        if let Some(mut t) = self.current.take() {
            let index = self.out.len();
            match (self.kind, self.delta.take()) {
                (FRAME_DELTA, Some((base_tag, result))) => {
                    // The payload was the block stream; the tensor is filled once applied,
                    // which starts now (the receiver waits for it once the bucket is in).
                    let bytes = std::mem::take(&mut t.bytes.0);
                    let len = expected_len(&t.shape, t.dtype).unwrap_or(0);
                    let elem = t.dtype.elem_size();
                    let work = apply::start(&self.bases, &t.name, base_tag, len, elem, bytes);
                    self.frames.deltas.push(PendingDelta {
                        index,
                        result,
                        work,
                    });
                }
                (FRAME_TENSOR, _) => self.frames.untagged.push(index),
                _ => {
                    if let Some((tag, r)) = self.running.take() {
                        let sum = r.finish(&t.bytes);
                        self.frames.tagged.push((index, tag, sum));
                    }
                }
            }
            self.out.push(t);
        }
        self.stage = Stage::Kind;
    }

    /// Moves past a complete header piece `h`.
    fn advance(&mut self, h: &[u8]) -> Result<(), String> {
        let idx = self.out.len();
        let stage = std::mem::replace(&mut self.stage, Stage::Kind);
        self.stage = match stage {
            Stage::Kind => match h[0] {
                k @ (FRAME_TENSOR | FRAME_WHOLE_TAGGED | FRAME_DELTA) => {
                    self.kind = k;
                    Stage::NameLen
                }
                FRAME_BUCKET_END => Stage::Count,
                other => return Err(format!("unknown frame kind {other} at tensor #{idx}")),
            },
            Stage::NameLen => Stage::Name {
                name_len: usize::from(u16::from_le_bytes([h[0], h[1]])),
            },
            Stage::Name { name_len } => {
                let name = String::from_utf8(h[..name_len].to_vec())
                    .map_err(|_| format!("tensor #{idx}: name is not UTF-8"))?;
                let code = h[name_len];
                let dtype = WireDtype::from_code(code)
                    .ok_or_else(|| format!("tensor {name}: unknown dtype code {code}"))?;
                let ndim = h[name_len + 1];
                if ndim > MAX_NDIM {
                    return Err(format!("tensor {name}: {ndim} dimensions"));
                }
                Stage::Dims {
                    name,
                    dtype,
                    ndim: usize::from(ndim),
                }
            }
            Stage::Dims { name, dtype, ndim } => self.start_tensor(h, name, dtype, ndim)?,
            Stage::Count => {
                let count = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
                if count != idx || count != self.expected.len() {
                    return Err(format!(
                        "bucket ended after {idx} tensors (sender counted {count}), expected {}",
                        self.expected.len()
                    ));
                }
                Stage::Done
            }
            Stage::Payload { .. } | Stage::Done => stage,
        };
        Ok(())
    }

    /// Checks a complete header against the spec of tensor #`out.len()`, then allocates.
    fn start_tensor(
        &mut self,
        h: &[u8],
        name: String,
        dtype: WireDtype,
        ndim: usize,
    ) -> Result<Stage, String> {
        let idx = self.out.len();
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        let mut shape = Vec::with_capacity(ndim);
        for i in 0..ndim {
            let d = word(i);
            shape.push(
                usize::try_from(d)
                    .map_err(|_| format!("tensor {name}: dimension {d} too large"))?,
            );
        }
        let byte_len = word(ndim);
        let want = expected_len(&shape, dtype).map(|w| w as u64);
        if byte_len > MAX_TENSOR_BYTES || want != Some(byte_len) {
            return Err(format!(
                "tensor {name}: {byte_len} bytes for shape {shape:?} of {}",
                dtype.as_str()
            ));
        }
        let Some(spec) = self.expected.get(idx) else {
            return Err(format!(
                "sender sent tensor {name} beyond the {idx} expected"
            ));
        };
        if spec.name != name || spec.dtype != dtype || spec.shape != shape {
            return Err(format!(
                "tensor #{idx}: expected {} {} {:?}, sender sent {name} {} {shape:?}",
                spec.name,
                spec.dtype.as_str(),
                spec.shape,
                dtype.as_str(),
            ));
        }
        // Checked against MAX_TENSOR_BYTES above, so this fits in usize on 64-bit targets.
        let len = usize::try_from(byte_len).map_err(|_| format!("tensor {name} too large"))?;
        let (bytes, len) = match self.kind {
            FRAME_WHOLE_TAGGED => {
                self.running = Some((word(ndim + 1), Running::default()));
                (self.buffer_for(&name, len), len)
            }
            FRAME_DELTA => {
                let enc = usize::try_from(word(ndim + 3)).unwrap_or(usize::MAX);
                if enc > max_encoded_len(len) {
                    return Err(format!(
                        "tensor {name}: a delta of {enc} bytes for a {len}-byte tensor"
                    ));
                }
                self.delta = Some((word(ndim + 1), word(ndim + 2)));
                (Vec::with_capacity(enc), enc)
            }
            _ => (self.buffer_for(&name, len), len),
        };
        self.current = Some(OwnedTensor {
            name,
            dtype,
            shape,
            bytes: TensorBytes(bytes),
        });
        if len == 0 {
            self.finish_tensor();
            return Ok(Stage::Kind);
        }
        Ok(Stage::Payload { remaining: len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::TensorRef;
    use crate::tcp::frame::{encode_end, encode_header};

    fn bucket() -> (Vec<TensorSpec>, Vec<u8>) {
        let a: Vec<u8> = (0..40).collect();
        let specs = vec![
            TensorSpec {
                name: "a".into(),
                dtype: WireDtype::F32,
                shape: vec![2, 5],
            },
            TensorSpec {
                name: "empty".into(),
                dtype: WireDtype::Bf16,
                shape: vec![0, 3],
            },
        ];
        let mut wire = Vec::new();
        for (s, bytes) in specs.iter().zip([&a[..], &[][..]]) {
            let t = TensorRef {
                name: &s.name,
                dtype: s.dtype,
                shape: &s.shape,
                bytes,
            };
            wire.extend(encode_header(&t).unwrap());
            wire.extend_from_slice(bytes);
        }
        wire.extend(encode_end(2).unwrap());
        (specs, wire)
    }

    #[test]
    fn spare_buffers_are_filled_instead_of_allocating() {
        let (specs, wire) = bucket();
        let mut first = Assembler::new(&specs);
        first.feed(&wire).unwrap();
        let first = first.into_tensors();
        let at = first[0].bytes.as_ptr();
        // A buffer too small to hold tensor "a", a larger one, and the one "a" was read into:
        // the best fit (the last) is chosen, the others stay spare.
        let spare = vec![
            Vec::with_capacity(8),
            Vec::with_capacity(4096),
            first.into_iter().next().unwrap().bytes.into_vec(),
        ];
        let mut asm = Assembler::with_spare(&specs, spare, SharedReceiverBases::default());
        asm.feed(&wire).unwrap();
        let left: Vec<usize> = asm.take_spare().iter().map(Vec::capacity).collect();
        let out = asm.into_tensors();
        assert_eq!(out[0].bytes, (0..40).collect::<Vec<u8>>());
        assert_eq!(out[0].bytes.as_ptr(), at, "the spare buffer was filled");
        assert_eq!(left.len(), 2);
        assert!(
            left.contains(&4096) && left.iter().any(|&c| c < 40),
            "{left:?}"
        );
    }

    #[test]
    fn any_chunking_decodes_the_same() {
        let (specs, wire) = bucket();
        assert_eq!(
            crate::tcp::frame::bucket_len(&specs).unwrap(),
            wire.len() as u64
        );
        for chunk in 1..=wire.len() {
            let mut asm = Assembler::new(&specs);
            for c in wire.chunks(chunk) {
                asm.feed(c).unwrap();
            }
            assert!(asm.is_done(), "chunk {chunk}");
            let out = asm.into_tensors();
            assert_eq!(out.len(), 2);
            assert_eq!(out[0].bytes, (0..40).collect::<Vec<u8>>());
            assert_eq!(out[1].shape, vec![0, 3]);
            assert!(out[1].bytes.is_empty());
        }
    }

    #[test]
    fn mismatches_are_named() {
        let (mut specs, wire) = bucket();
        specs[0].shape = vec![5, 2];
        let err = Assembler::new(&specs).feed(&wire).unwrap_err();
        assert!(
            err.contains("expected a float32 [5, 2]") && err.contains("[2, 5]"),
            "{err}"
        );
        let (specs, mut wire) = bucket();
        wire[0] = 9;
        let err = Assembler::new(&specs).feed(&wire).unwrap_err();
        assert!(err.contains("unknown frame kind 9"), "{err}");
        let (specs, wire) = bucket();
        let mut extra = wire.clone();
        extra.push(0);
        let err = Assembler::new(&specs).feed(&extra).unwrap_err();
        assert!(err.contains("after the end"), "{err}");
        let err = Assembler::new(&specs[..1]).feed(&wire).unwrap_err();
        assert!(err.contains("beyond the 1 expected"), "{err}");
    }
}
