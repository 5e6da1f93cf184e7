//! A consumed DLPack tensor and the one duty its consumer has: calling the producer's
//! `deleter` exactly once, when the values are no longer read. Its own module because both the
//! DLPack reader ([`crate::dlpack`], which consumes the capsule) and the in-place values
//! ([`crate::in_place::Owner`], which keep it alive) hold one.

use dlpark::ffi::DLManagedTensor;

/// A DLPack tensor this process consumed; its producer is told when it is dropped.
pub struct Managed(*mut DLManagedTensor);

// SAFETY: the producer's memory is only read; DLPack deleters may be called from any thread
// (producers that need the GIL take it themselves, as numpy and torch do).
unsafe impl Send for Managed {}
unsafe impl Sync for Managed {}

impl Managed {
    /// Takes ownership of `raw`, whose deleter then runs when this is dropped.
    ///
    /// # Safety
    /// `raw` must be a valid DLPack tensor this process consumed (its capsule renamed
    /// `used_dltensor`), so that nobody else calls its deleter.
    pub unsafe fn new(raw: *mut DLManagedTensor) -> Self {
        Managed(raw)
    }

    /// The tensor, valid until this is dropped.
    pub fn as_ptr(&self) -> *mut DLManagedTensor {
        self.0
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a capsule we renamed `used_dltensor`, so we own it and
        // call its deleter exactly once.
        unsafe {
            if let Some(deleter) = (*self.0).deleter {
                deleter(self.0);
            }
        }
    }
}
