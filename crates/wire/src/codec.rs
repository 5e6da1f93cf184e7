//! The payload codec for typed actor calls.
//!
//! Payloads are MessagePack with named fields: compact and fast like bincode, but
//! self-describing, so a Python or Go caller with an off-the-shelf msgpack library can talk to
//! any actor without knowing Rust's struct layout.

use serde::{Serialize, de::DeserializeOwned};

/// A payload could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be serialized.
    #[error("cannot encode payload: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    /// The bytes are not a valid MessagePack encoding of the expected type.
    #[error("cannot decode payload as {ty}: {source}")]
    Decode {
        /// The Rust type we tried to decode into.
        ty: &'static str,
        /// What went wrong.
        source: rmp_serde::decode::Error,
    },
}

/// Encodes a value as named-field MessagePack.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(rmp_serde::to_vec_named(value)?)
}

/// Decodes a value from MessagePack bytes, naming the expected type on failure.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    rmp_serde::from_slice(bytes).map_err(|source| CodecError::Decode {
        ty: std::any::type_name::<T>(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Ping {
        n: u64,
        s: String,
    }

    #[test]
    fn round_trip() {
        let v = Ping {
            n: 7,
            s: "x".into(),
        };
        let b = encode(&v).unwrap();
        assert_eq!(decode::<Ping>(&b).unwrap(), v);
    }

    #[test]
    fn garbage_is_a_typed_error() {
        let e = decode::<Ping>(&[0xc1, 0x00]).unwrap_err();
        assert!(e.to_string().contains("Ping"), "{e}");
    }
}
