//! The bytes of a received tensor, readable but not writable.
//!
//! Why: with delta updates on, the buffer an engine hands back with
//! [`recycle`](super::WeightReceiver::recycle) becomes the base the next delta is applied to,
//! and the receiver's checksum of it was computed as it arrived ([`crate::delta::sum`]). If the
//! engine could write to it, a change where no later delta writes would go unseen. So an engine
//! reads through `Deref<Target = [u8]>`; one that wants the buffer for itself takes it with
//! [`into_vec`](TensorBytes::into_vec), and that tensor simply comes whole next time.

use std::ops::Deref;

/// A received tensor's bytes (see the module docs): no way to change them in place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorBytes(pub(super) Vec<u8>);

impl TensorBytes {
    /// Takes the buffer for good (it is then the caller's to change; the receiver will not
    /// get it back, so the next update sends this tensor whole).
    pub fn into_vec(self) -> Vec<u8> {
        self.0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }
}

impl Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl PartialEq<Vec<u8>> for TensorBytes {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.0 == *other
    }
}

impl PartialEq<[u8]> for TensorBytes {
    fn eq(&self, other: &[u8]) -> bool {
        self.0 == other
    }
}

impl PartialEq<TensorBytes> for Vec<u8> {
    fn eq(&self, other: &TensorBytes) -> bool {
        *self == other.0
    }
}
