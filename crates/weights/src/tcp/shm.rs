//! A shared-memory ring for engines on rank 0's own machine.
//!
//! On one machine a TCP chain moves every byte through the kernel twice per engine (in from
//! the predecessor, out to the successor), so eight engines cost sixteen copies of the model
//! where one engine costs two. Here rank 0 writes each piece once into a ring that every local
//! engine maps read-only and copies out of: eight engines cost nine copies, and while the ring
//! is small each piece is read by all of them while it is still in the shared cache. This is
//! what NCCL's shared-memory transport does between ranks on one node.
//!
//! The ring is an anonymous `memfd` that rank 0 owns: nothing is left on any filesystem, and
//! it is gone when rank 0 and every engine that mapped it are. An engine opens it through
//! `/proc/<pid>/fd/<fd>` and proves it reached rank 0's segment (not a same-numbered process on
//! another machine, or in another PID namespace) by the random nonce rank 0 wrote in its header.
//! Anything that goes wrong on the way (another OS, no `/proc`, a container boundary) leaves
//! that engine on the TCP chain; nothing depends on shared memory being possible.
//!
//! Flow control does not live in the segment: rank 0 tells each engine how far the ring is
//! filled (`u64` absolute byte positions) over its data link, and each engine answers how far it
//! has read, so a dead engine shows up as a closed socket, exactly as on the chain.

use std::io;

/// Bytes at the start of the segment before the ring: magic and nonce, padded to a page.
const HEADER: usize = 4096;
/// Identifies a troupe weight ring.
const SHM_MAGIC: &[u8; 4] = b"TRWS";
/// Ring size rank 0 uses unless told otherwise: small enough that a piece is read by every
/// local engine while it is still in the last-level cache, large enough that one slow engine
/// does not stall the writer at once.
pub const DEFAULT_RING_BYTES: usize = 8 << 20;
/// Smallest ring accepted (a ring smaller than a page buys nothing).
pub const MIN_RING_BYTES: usize = 64 << 10;
/// Largest ring accepted.
pub const MAX_RING_BYTES: usize = 1 << 30;

/// What rank 0 tells a local engine so it can map the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Offer {
    /// Where the engine opens the segment (`/proc/<pid>/fd/<fd>`).
    pub path: String,
    /// Random value written in the segment's header.
    pub nonce: [u8; 16],
    /// Ring bytes (the segment is [`HEADER`] plus this).
    pub ring: u64,
}

/// A mapped segment: read-write at rank 0, read-only at engines.
#[derive(Debug)]
pub(crate) struct Segment {
    ptr: *mut u8,
    map_len: usize,
    ring: usize,
    /// Rank 0's memfd (kept open so engines can open it through `/proc`); `None` at engines,
    /// which close theirs once mapped.
    _fd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through `&mut self`
// (writes, rank 0) or through ranges the protocol says nobody writes while they are read.
unsafe impl Send for Segment {}
// SAFETY: as above; `&self` only reads.
unsafe impl Sync for Segment {}

impl Segment {
    /// Ring bytes.
    pub(crate) fn ring_len(&self) -> usize {
        self.ring
    }

    /// Copies `src` into the ring at absolute position `pos`. The caller keeps `src` within
    /// one lap (`pos % ring + src.len() <= ring`) and writes only bytes every engine has read.
    pub(crate) fn write(&mut self, pos: u64, src: &[u8]) {
        let at = (pos % self.ring as u64) as usize;
        assert!(at + src.len() <= self.ring, "ring write crosses the end");
        // SAFETY: `HEADER + at .. HEADER + at + len` lies inside the mapping (checked above),
        // which is writable at rank 0 (the only caller with a `&mut` segment).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(HEADER + at), src.len());
        }
    }

    /// The `len` ring bytes at absolute position `pos` (within one lap). Only meaningful for
    /// bytes rank 0 has published and not yet been told it may overwrite.
    pub(crate) fn read(&self, pos: u64, len: usize) -> &[u8] {
        let at = (pos % self.ring as u64) as usize;
        assert!(at + len <= self.ring, "ring read crosses the end");
        // SAFETY: inside the mapping (checked above); rank 0 does not write a published range
        // until this engine has reported it read, so the bytes do not change while borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.add(HEADER + at), len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`map_len` are exactly what `mmap` returned; nothing borrows the
        // mapping past `self`.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::munmap(self.ptr.cast(), self.map_len);
        }
    }
}

/// A nonce nobody else can guess or repeat: hashes of the clock, the process and a fresh
/// `RandomState` (seeded from the OS).
fn nonce() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for half in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.write_u32(std::process::id());
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

#[cfg(target_os = "linux")]
mod imp {
    use std::ffi::CString;
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::{HEADER, Offer, SHM_MAGIC, Segment, nonce};

    fn map(fd: &OwnedFd, len: usize, writable: bool) -> io::Result<*mut u8> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of `len` bytes of `fd`; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(p.cast())
    }

    /// Rank 0: a new memfd of `ring` bytes plus the header, mapped read-write, with a fresh
    /// nonce, and the offer engines need to map it.
    pub(crate) fn create(ring: usize) -> io::Result<(Segment, Offer)> {
        let name = CString::new("troupe-weight-ring").map_err(io::Error::other)?;
        // SAFETY: plain syscall with a valid C string; the result is checked.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let map_len = HEADER + ring;
        let len = libc::off_t::try_from(map_len).map_err(io::Error::other)?;
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let ptr = map(&fd, map_len, true)?;
        let nonce = nonce();
        // SAFETY: the header lies inside the fresh mapping, which nothing else references yet.
        unsafe {
            std::ptr::copy_nonoverlapping(SHM_MAGIC.as_ptr(), ptr, 4);
            std::ptr::copy_nonoverlapping(nonce.as_ptr(), ptr.add(4), 16);
        }
        let offer = Offer {
            path: format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd()),
            nonce,
            ring: ring as u64,
        };
        let seg = Segment {
            ptr,
            map_len,
            ring,
            _fd: Some(fd),
        };
        Ok((seg, offer))
    }

    /// An engine: opens and maps the offered segment read-only, and checks it is rank 0's.
    pub(crate) fn open(offer: &Offer) -> Result<Segment, String> {
        let ring = usize::try_from(offer.ring)
            .ok()
            .filter(|r| (super::MIN_RING_BYTES..=super::MAX_RING_BYTES).contains(r))
            .ok_or_else(|| format!("ring of {} bytes is out of range", offer.ring))?;
        if !offer.path.starts_with("/proc/") {
            return Err(format!("{} is not a /proc descriptor path", offer.path));
        }
        let path = CString::new(offer.path.as_str()).map_err(|e| e.to_string())?;
        // Non-blocking, so a path that names a FIFO on another machine cannot hang the open.
        // SAFETY: plain syscall with a valid C string; the result is checked.
        let raw = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY,
            )
        };
        if raw < 0 {
            return Err(format!(
                "cannot open {}: {}",
                offer.path,
                io::Error::last_os_error()
            ));
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let map_len = HEADER + ring;
        // SAFETY: `st` is plain old data filled by the kernel; the result is checked.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(format!(
                "cannot stat {}: {}",
                offer.path,
                io::Error::last_os_error()
            ));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != map_len as u64 {
            return Err(format!("{} is not the weight ring", offer.path));
        }
        let ptr =
            map(&fd, map_len, false).map_err(|e| format!("cannot map {}: {e}", offer.path))?;
        let seg = Segment {
            ptr,
            map_len,
            ring,
            _fd: None,
        };
        // SAFETY: the header lies inside the mapping; rank 0 wrote it before offering.
        let header = unsafe { std::slice::from_raw_parts(ptr.cast_const(), 20) };
        if &header[..4] != SHM_MAGIC || header[4..20] != offer.nonce {
            return Err(format!(
                "{} is not rank 0's weight ring (another machine or PID namespace)",
                offer.path
            ));
        }
        Ok(seg)
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;

    use super::{Offer, Segment};

    pub(crate) fn create(_ring: usize) -> io::Result<(Segment, Offer)> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "shared-memory weight rings need Linux",
        ))
    }

    pub(crate) fn open(_offer: &Offer) -> Result<Segment, String> {
        Err("shared-memory weight rings need Linux".into())
    }
}

/// Rank 0: a new ring of `ring` bytes and the offer for engines (Linux only).
pub(crate) fn create(ring: usize) -> io::Result<(Segment, Offer)> {
    imp::create(ring)
}

/// An engine: maps the offered ring read-only, or says why it cannot.
pub(crate) fn open(offer: &Offer) -> Result<Segment, String> {
    imp::open(offer)
}
