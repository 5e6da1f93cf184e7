//! Values read where they lie: a buffer someone else owns (a numpy array, a consumed DLPack
//! tensor) handed to the weight sync as [`SharedValues`] without a copy. Both argument routes,
//! numpy ([`crate::arrays`]) and DLPack ([`crate::dlpack`]), build these, so they live below
//! both.

use half::bf16;
use pyo3::prelude::*;
use pyo3::types::PyAny;
use troupe_serving::control_plane::SharedValues;
use troupe_weights::fp8::Weights;

use crate::managed::Managed;

/// Element type a shared buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// IEEE f32.
    F32,
    /// bfloat16 bits.
    Bf16,
}

/// What keeps a shared buffer alive (held, never read: dropping it releases the buffer).
#[allow(dead_code)]
pub enum Owner {
    /// A Python object (a numpy array).
    Py(Py<PyAny>),
    /// A consumed DLPack tensor, released when the values are dropped.
    DlPack(Managed),
}

/// Values in a buffer that `owner` keeps alive.
pub struct InPlace {
    _owner: Owner,
    ptr: *const u8,
    len: usize,
    kind: Kind,
}

// SAFETY: the buffer is only read, and `owner` keeps it alive for as long as `InPlace` lives;
// dropping a `Py` without the GIL is deferred by PyO3, and DLPack deleters may run on any thread.
unsafe impl Send for InPlace {}
unsafe impl Sync for InPlace {}

impl InPlace {
    /// # Safety
    /// `ptr` must point to `len` elements of `kind`, aligned, that stay valid and unwritten
    /// while `owner` lives.
    pub unsafe fn new(owner: Owner, ptr: *const u8, len: usize, kind: Kind) -> Self {
        InPlace {
            _owner: owner,
            ptr,
            len,
            kind,
        }
    }
}

impl SharedValues for InPlace {
    fn values(&self) -> Weights<'_> {
        if self.len == 0 {
            return match self.kind {
                Kind::F32 => Weights::F32(&[]),
                Kind::Bf16 => Weights::Bf16(&[]),
            };
        }
        // SAFETY: see `InPlace::new`; `half::bf16` is `repr(transparent)` over `u16`.
        unsafe {
            match self.kind {
                Kind::F32 => Weights::F32(std::slice::from_raw_parts(self.ptr.cast(), self.len)),
                Kind::Bf16 => Weights::Bf16(std::slice::from_raw_parts(
                    self.ptr.cast::<bf16>(),
                    self.len,
                )),
            }
        }
    }
}
