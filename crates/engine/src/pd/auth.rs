//! Mutual authentication of a KV handoff with the deployment's bootstrap secret.
//!
//! A decode engine connects to whatever `bootstrap_host` a request names, and a prefill hands
//! KV to whoever asks for a room: without a check, a request could point a decode at another
//! deployment's (or an attacker's) prefill, or anyone could read a room's KV. When the
//! deployment gives its engines a secret (`TROUPE_BOOTSTRAP_SECRET`), each side proves it
//! knows it without sending it: the decode's request carries a nonce, the prefill answers with
//! its own nonce and `HMAC-SHA256(secret, "P" ‖ decode nonce ‖ room)`, and the decode replies
//! with `HMAC-SHA256(secret, "D" ‖ prefill nonce ‖ room)`. Only then does KV flow.

use ring::hmac;

/// Length of each side's nonce.
pub const NONCE_LEN: usize = 16;
/// Length of a proof (HMAC-SHA256).
pub const TAG_LEN: usize = 32;

/// A deployment's bootstrap secret, ready to prove and check.
#[derive(Clone)]
pub struct Secret(hmac::Key);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Which side a proof comes from (so one side's proof is never valid for the other).
#[derive(Debug, Clone, Copy)]
pub enum Side {
    /// The prefill (answering a fetch).
    Prefill,
    /// The decode (fetching).
    Decode,
}

impl Secret {
    /// The secret from its text; empty means none.
    pub fn new(text: &str) -> Option<Secret> {
        (!text.is_empty()).then(|| Secret(hmac::Key::new(hmac::HMAC_SHA256, text.as_bytes())))
    }

    fn message(side: Side, nonce: &[u8; NONCE_LEN], room: u64) -> Vec<u8> {
        let mut m = Vec::with_capacity(1 + NONCE_LEN + 8);
        m.push(match side {
            Side::Prefill => b'P',
            Side::Decode => b'D',
        });
        m.extend_from_slice(nonce);
        m.extend_from_slice(&room.to_le_bytes());
        m
    }

    /// `side`'s proof over the other side's `nonce` for `room`.
    pub fn prove(&self, side: Side, nonce: &[u8; NONCE_LEN], room: u64) -> [u8; TAG_LEN] {
        let tag = hmac::sign(&self.0, &Self::message(side, nonce, room));
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Whether `tag` is `side`'s proof over `nonce` for `room` (constant time).
    pub fn check(&self, side: Side, nonce: &[u8; NONCE_LEN], room: u64, tag: &[u8]) -> bool {
        hmac::verify(&self.0, &Self::message(side, nonce, room), tag).is_ok()
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    *uuid::Uuid::new_v4().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_the_side_the_nonce_and_the_room() {
        let (a, b) = (Secret::new("s1").unwrap(), Secret::new("s2").unwrap());
        let n = nonce();
        let t = a.prove(Side::Prefill, &n, 7);
        assert!(a.check(Side::Prefill, &n, 7, &t));
        assert!(!b.check(Side::Prefill, &n, 7, &t), "another secret");
        assert!(!a.check(Side::Decode, &n, 7, &t), "the other side");
        assert!(!a.check(Side::Prefill, &n, 8, &t), "another room");
        assert!(!a.check(Side::Prefill, &nonce(), 7, &t), "another nonce");
        assert!(Secret::new("").is_none());
    }
}
