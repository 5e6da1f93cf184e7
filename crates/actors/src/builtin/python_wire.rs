//! The frames between a `troupe.python` actor and its worker process (`troupe/_worker.py`):
//! a little-endian `u32` length, then one MessagePack value with named fields. The actor sends
//! [`Hello`] once, then one [`Request`] per call; the worker answers each with one [`Reply`].

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest frame either side accepts (a bound on what a broken worker can make us allocate).
pub const MAX_FRAME: usize = 2 << 30;

/// What to build: the first frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// `package.module:QualName`.
    pub target: String,
    /// The controller's `__main__` file, when the class lives there.
    pub main_file: Option<String>,
    /// Entries to put first on `sys.path`.
    pub sys_path: Vec<String>,
    /// Encoded `(args, kwargs)` of the constructor.
    #[serde(with = "serde_bytes")]
    pub init: Vec<u8>,
}

/// One call (also the `troupe.python` actor's message, `PyCall`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// Method name.
    pub method: String,
    /// Encoded `(args, kwargs)`.
    #[serde(with = "serde_bytes")]
    pub args: Vec<u8>,
}

/// A Python exception, as the worker formats it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Raised {
    /// The exception's class, e.g. `ValueError`.
    pub kind: String,
    /// `str(exception)`.
    pub message: String,
    /// The formatted traceback.
    pub traceback: String,
}

/// The worker's answer to [`Hello`] (`Ok` with no bytes) or to a [`Request`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Done; the encoded result.
    Ok(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The call (or the import / constructor) raised.
    Raised(Raised),
}

/// Writes one frame, its length and body in one write: the worker reads the length first, and a
/// length that arrived alone would wake it twice per call.
pub async fn write_frame<T: Serialize>(s: &mut UnixStream, v: &T) -> std::io::Result<()> {
    let mut frame = vec![0u8; 4];
    rmp_serde::encode::write_named(&mut frame, v).map_err(std::io::Error::other)?;
    let body = frame.len() - 4;
    let len = u32::try_from(body)
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME)
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "a frame of {body} bytes exceeds the limit of {MAX_FRAME}"
            ))
        })?;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    s.write_all(&frame).await?;
    s.flush().await
}

/// Reads one frame; EOF, an oversized length or a bad body is an error.
pub async fn read_frame<T: DeserializeOwned>(s: &mut UnixStream) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "the worker sent a frame of {len} bytes (limit {MAX_FRAME})"
        )));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    rmp_serde::from_slice(&body).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bad_frames_are_refused() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let req = Request {
            method: "train_batch".into(),
            args: vec![0, 1, 255],
        };
        write_frame(&mut a, &req).await.unwrap();
        let got: Request = read_frame(&mut b).await.unwrap();
        assert_eq!(
            (got.method.as_str(), got.args.as_slice()),
            ("train_batch", &[0u8, 1, 255][..])
        );

        // What the Python worker writes: {"Raised": {...}} with named fields.
        let raised = Reply::Raised(Raised {
            kind: "ValueError".into(),
            message: "bad".into(),
            traceback: "Traceback ...".into(),
        });
        write_frame(&mut b, &raised).await.unwrap();
        match read_frame::<Reply>(&mut a).await.unwrap() {
            Reply::Raised(r) => assert_eq!(r.kind, "ValueError"),
            Reply::Ok(_) => panic!("expected Raised"),
        }

        // A length over the limit is refused before anything is allocated.
        a.write_all(&(MAX_FRAME as u32 + 1).to_le_bytes())
            .await
            .unwrap();
        assert!(read_frame::<Reply>(&mut b).await.is_err());
        // A closed peer is an error (EOF), not a hang.
        drop(a);
        assert!(read_frame::<Reply>(&mut b).await.is_err());
    }
}
