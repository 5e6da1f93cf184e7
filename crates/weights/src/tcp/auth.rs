//! The group secret: what an engine proves it knows to join a group, and what every data link
//! proves, so that knowing rank 0's port and the group name (neither is secret) is not enough
//! to take a rank and read the weights.
//!
//! The secret never crosses a weight-transport socket: each side answers a fresh random
//! challenge with an HMAC-SHA256 of it keyed by the secret, and tags are checked in constant
//! time (`ring::hmac::verify`).

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::TcpError;

/// Bytes of a secret.
pub(crate) const SECRET_BYTES: usize = 32;
/// Bytes of a challenge nonce.
pub(crate) const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub(crate) const TAG_BYTES: usize = 32;

/// What a tag is for, so a tag made for one step is never accepted for another.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Purpose {
    /// An engine's join: over rank 0's challenge and the join's fields.
    Join,
    /// Rank 0's answer: over the engine's nonce and rank 0's challenge.
    Admit,
    /// A data link's hello: over the acceptor's challenge and the two ranks.
    Link,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Self::Join => b"troupe-weights/5 join",
            Self::Admit => b"troupe-weights/5 admit",
            Self::Link => b"troupe-weights/5 link",
        }
    }
}

/// A weight-update group's shared secret (32 random bytes, written as 64 hex digits).
#[derive(Clone)]
pub(crate) struct GroupSecret {
    bytes: [u8; SECRET_BYTES],
    key: hmac::Key,
}

impl std::fmt::Debug for GroupSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupSecret(..)")
    }
}

impl GroupSecret {
    /// A fresh secret from the system's CSPRNG.
    pub(crate) fn generate() -> Result<Self, TcpError> {
        let mut bytes = [0u8; SECRET_BYTES];
        SystemRandom::new().fill(&mut bytes).map_err(|_| {
            TcpError::Io(std::io::Error::other(
                "no system randomness for the group secret",
            ))
        })?;
        Ok(Self::from_bytes(bytes))
    }

    fn from_bytes(bytes: [u8; SECRET_BYTES]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
            bytes,
        }
    }

    /// Parses the 64 hex digits [`to_hex`](Self::to_hex) writes; anything else is refused by
    /// name (an empty secret included: a join without one is never accepted).
    pub(crate) fn parse(hex: &str) -> Result<Self, TcpError> {
        let hex = hex.trim();
        let bad = || {
            TcpError::InvalidArgument(format!(
                "the group secret must be the {} hex digits rank 0's WeightSender::secret() \
                 gives (the init call's group_secret); got {} characters",
                SECRET_BYTES * 2,
                hex.len()
            ))
        };
        if hex.len() != SECRET_BYTES * 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut bytes = [0u8; SECRET_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self::from_bytes(bytes))
    }

    /// The secret as 64 lowercase hex digits.
    pub(crate) fn to_hex(&self) -> String {
        self.bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The tag of `parts` for `purpose`.
    pub(crate) fn tag(&self, purpose: Purpose, parts: &[&[u8]]) -> [u8; TAG_BYTES] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(purpose.label());
        for p in parts {
            ctx.update(&(p.len() as u64).to_le_bytes());
            ctx.update(p);
        }
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    /// Whether `tag` is the tag of `parts` for `purpose` (compared in constant time).
    pub(crate) fn verify(&self, purpose: Purpose, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut msg = Vec::with_capacity(64);
        msg.extend_from_slice(purpose.label());
        for p in parts {
            msg.extend_from_slice(&(p.len() as u64).to_le_bytes());
            msg.extend_from_slice(p);
        }
        hmac::verify(&self.key, &msg, tag).is_ok()
    }
}

/// A fresh random challenge.
pub(crate) fn nonce() -> Result<[u8; NONCE_BYTES], TcpError> {
    let mut n = [0u8; NONCE_BYTES];
    SystemRandom::new().fill(&mut n).map_err(|_| {
        TcpError::Io(std::io::Error::other(
            "no system randomness for a challenge",
        ))
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_round_trip_and_bad_ones_are_refused_by_name() {
        let s = GroupSecret::generate().unwrap();
        let hex = s.to_hex();
        assert_eq!(hex.len(), 64);
        let back = GroupSecret::parse(&hex).unwrap();
        assert_eq!(back.to_hex(), hex);
        for bad in ["", "abc", &"zz".repeat(32), &"é".repeat(32)] {
            match GroupSecret::parse(bad) {
                Err(TcpError::InvalidArgument(m)) => assert!(m.contains("group secret"), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert_ne!(GroupSecret::generate().unwrap().to_hex(), hex);
        assert_eq!(format!("{s:?}"), "GroupSecret(..)");
    }

    #[test]
    fn tags_bind_the_secret_the_purpose_and_every_part() {
        let s = GroupSecret::generate().unwrap();
        let other = GroupSecret::generate().unwrap();
        let t = s.tag(Purpose::Join, &[b"ab", b"c"]);
        assert!(s.verify(Purpose::Join, &[b"ab", b"c"], &t));
        assert!(!other.verify(Purpose::Join, &[b"ab", b"c"], &t));
        assert!(!s.verify(Purpose::Link, &[b"ab", b"c"], &t));
        assert!(!s.verify(Purpose::Join, &[b"a", b"bc"], &t));
        assert!(!s.verify(Purpose::Join, &[b"ab", b"c"], &t[..31]));
    }
}
