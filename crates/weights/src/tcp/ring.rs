//! Moving bucket bytes through the shared-memory ring ([`super::shm`]): rank 0 writes the same
//! byte stream a chain link would carry, engines feed it to the same decoder.
//!
//! Positions are absolute byte counts since the group formed (they never reset between
//! buckets), so a position message left over from an earlier bucket can only understate how far
//! an engine got, never overstate it. Rank 0 announces how far it has written every
//! [`publish_every`] bytes and at the end of a bucket; an engine answers how far it has read at
//! the same granularity and once it has the whole bucket.

use std::sync::atomic::{Ordering, fence};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::assemble::Assembler;
use super::shm::Segment;

/// Most bytes written (or read) between two position messages: a quarter of a millisecond of
/// copying, so messages cost little (8 receivers of 512 MiB through an 8 MiB ring: 0.185-0.19 s
/// against 0.20-0.21 s with 1 MiB), while a ring holds several of them.
const PUBLISH_BYTES: usize = 4 << 20;

/// Bytes between position messages for a ring of `ring` bytes (at most a quarter of it, so
/// the writer never waits for a whole lap to be read).
pub(crate) fn publish_every(ring: usize) -> usize {
    PUBLISH_BYTES.min(ring / 4).max(1)
}

/// Rank 0's side: the ring and a data link to every engine that mapped it.
#[derive(Debug)]
pub(crate) struct RingSender {
    seg: Segment,
    /// `(first rank, data link)` per engine, in rank order.
    links: Vec<(u32, TcpStream)>,
    /// How far each engine has said it read (same order as `links`).
    read: Vec<u64>,
    written: u64,
}

impl RingSender {
    pub(crate) fn new(seg: Segment, links: Vec<(u32, TcpStream)>) -> Self {
        let read = vec![0; links.len()];
        Self {
            seg,
            links,
            read,
            written: 0,
        }
    }

    /// Ranks reached through the ring.
    pub(crate) fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.links.iter().map(|(r, _)| *r)
    }

    /// Writes `pieces` (one bucket's frames, in order) into the ring, announcing progress, and
    /// returns once every engine has said it read all of it. A broken or misbehaving link
    /// comes back as `(rank, reason)`.
    pub(crate) async fn send(&mut self, pieces: &[&[u8]]) -> Result<(), (u32, String)> {
        let ring = self.seg.ring_len();
        let every = publish_every(ring) as u64;
        let mut since = 0u64;
        for piece in pieces {
            let mut off = 0;
            while off < piece.len() {
                let low = self.read.iter().copied().min().unwrap_or(self.written);
                let free = ring - (self.written - low) as usize;
                if free == 0 {
                    self.wait_slowest().await?;
                    continue;
                }
                let at = (self.written % ring as u64) as usize;
                let n = free
                    .min(ring - at)
                    .min(piece.len() - off)
                    .min((every - since) as usize);
                self.seg.write(self.written, &piece[off..off + n]);
                self.written += n as u64;
                since += n as u64;
                off += n;
                if since == every {
                    self.publish().await?;
                    since = 0;
                }
            }
        }
        if since > 0 {
            self.publish().await?;
        }
        for i in 0..self.links.len() {
            while self.read[i] < self.written {
                self.read_position(i).await?;
            }
        }
        Ok(())
    }

    /// Tells every engine how far the ring is written.
    async fn publish(&mut self) -> Result<(), (u32, String)> {
        // The bytes must be visible before an engine can learn they are there.
        fence(Ordering::Release);
        let msg = self.written.to_le_bytes();
        for (rank, link) in &mut self.links {
            link.write_all(&msg)
                .await
                .map_err(|e| (*rank, format!("ring link to rank {rank} failed: {e}")))?;
        }
        Ok(())
    }

    /// Waits for the engine furthest behind to report progress.
    async fn wait_slowest(&mut self) -> Result<(), (u32, String)> {
        let i = (0..self.read.len())
            .min_by_key(|&i| self.read[i])
            .unwrap_or(0);
        self.read_position(i).await
    }

    /// Reads one position message from engine `i`.
    async fn read_position(&mut self, i: usize) -> Result<(), (u32, String)> {
        let (rank, link) = &mut self.links[i];
        let rank = *rank;
        let pos = link.read_u64_le().await.map_err(|e| {
            (
                rank,
                format!(
                    "ring link to rank {rank} failed after it read {} bytes: {e}",
                    self.read[i]
                ),
            )
        })?;
        if pos > self.written || pos < self.read[i] {
            return Err((
                rank,
                format!(
                    "rank {rank} reported reading up to byte {pos} of the ring, but {} are \
                     written and it had read {}",
                    self.written, self.read[i]
                ),
            ));
        }
        self.read[i] = pos;
        Ok(())
    }
}

/// Why an engine's ring read stopped.
#[derive(Debug)]
pub(crate) enum RingFailure {
    /// The link to rank 0 broke or carried nonsense.
    Upstream(String),
    /// The bytes do not match what this engine was told to expect.
    Mine(String),
    /// `stop_at` was reached (tests: the engine "dies" there).
    Stopped,
}

/// An engine's side: the mapped ring, the data link from rank 0, and how far it has read.
#[derive(Debug)]
pub(crate) struct RingReceiver {
    pub(crate) seg: Segment,
    /// Absolute ring position read up to.
    pub(crate) read: u64,
    /// Absolute position rank 0 has announced.
    pub(crate) known: u64,
}

impl RingReceiver {
    pub(crate) fn new(seg: Segment) -> Self {
        Self {
            seg,
            read: 0,
            known: 0,
        }
    }

    /// Feeds one bucket from the ring to `asm` (until its end frame), following rank 0's
    /// announcements on `link` and reporting progress on it. `stop_at` (tests) makes it stop
    /// early as if killed.
    pub(crate) async fn receive(
        &mut self,
        link: &mut TcpStream,
        asm: &mut Assembler<'_>,
        stop_at: Option<u64>,
    ) -> Result<(), RingFailure> {
        let ring = self.seg.ring_len();
        let every = publish_every(ring) as u64;
        let start = self.read;
        let mut reported = self.read;
        let up = |got: u64, e: std::io::Error| {
            RingFailure::Upstream(format!(
                "ring link from rank 0 failed after {got} bytes of the bucket: {e}"
            ))
        };
        while !asm.is_done() {
            if stop_at.is_some_and(|n| self.read - start >= n) {
                return Err(RingFailure::Stopped);
            }
            if self.known == self.read {
                let pos = link
                    .read_u64_le()
                    .await
                    .map_err(|e| up(self.read - start, e))?;
                if pos < self.known || pos - self.read > ring as u64 {
                    return Err(RingFailure::Upstream(format!(
                        "rank 0 announced ring position {pos}, but this engine is at {} of a \
                         {ring}-byte ring",
                        self.read
                    )));
                }
                fence(Ordering::Acquire);
                self.known = pos;
                continue;
            }
            let at = (self.read % ring as u64) as usize;
            let n = ((self.known - self.read) as usize)
                .min(ring - at)
                .min((every - (self.read - reported).min(every)) as usize)
                .max(1);
            let src = self.seg.read(self.read, n);
            let n = match asm.payload_room() {
                Some((dst, remaining)) => {
                    let k = remaining.min(n);
                    append_streaming(dst, &src[..k]);
                    asm.filled(k);
                    k
                }
                None => {
                    let k = asm.header_want().min(n);
                    asm.feed(&src[..k]).map_err(RingFailure::Mine)?;
                    k
                }
            };
            self.read += n as u64;
            if self.read - reported >= every || asm.is_done() {
                link.write_all(&self.read.to_le_bytes())
                    .await
                    .map_err(|e| up(self.read - start, e))?;
                reported = self.read;
            }
        }
        Ok(())
    }
}

/// Smallest copy worth bypassing the cache for.
const STREAM_MIN: usize = 64 << 10;

/// Appends `src` to `dst` with non-temporal stores when it is large: a tensor is written once
/// here and read much later, so pulling its lines into the cache first (as an ordinary copy
/// does) only costs memory bandwidth that the other engines reading the ring need.
pub(crate) fn append_streaming(dst: &mut Vec<u8>, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        dst.reserve(src.len());
        let len = dst.len();
        // SAFETY: `reserve` made room for `src.len()` bytes past `len`; every byte of that range
        // is written below before `set_len` covers it; SSE2 is part of x86_64.
        unsafe {
            let d = dst.as_mut_ptr().add(len);
            let head = d.align_offset(16).min(src.len());
            std::ptr::copy_nonoverlapping(src.as_ptr(), d, head);
            let body = (src.len() - head) / 64 * 64;
            let (s, d) = (src.as_ptr().add(head), d.add(head));
            let mut i = 0;
            while i < body {
                let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
                _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), src.len() - head - body);
            _mm_sfence();
            dst.set_len(len + src.len());
        }
        return;
    }
    dst.extend_from_slice(src);
}
