//! The frames between a `troupe.python` actor and its worker process (`troupe/_worker.py`):
//! a little-endian `u32` length, then one MessagePack value with named fields. The actor sends
//! [`Hello`] once (answered by a [`Reply`]), then one [`Call`] per method call; the worker
//! answers each with an [`Answer`] carrying the call's id, so that a worker running several
//! `async def` methods at once can answer them in the order they finish.
//!
//! This file is the format's one home. The worker's copy of its constants is
//! `python/troupe/_frames.py` (constants only); the test `python_frames_match_the_rust_ones`
//! reads that file and fails when a name or value there differs from what is defined here, so
//! the two sides cannot drift apart silently.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Environment variable naming the worker's end of the socket pair (the worker opens that fd).
pub const FD_ENV: &str = "TROUPE_WORKER_FD";

/// Largest frame either side accepts (a bound on what a broken worker can make us allocate).
pub const MAX_FRAME: usize = 2 << 30;

/// Bytes of the length before each body: a little-endian `u32`.
const LENGTH_BYTES: usize = std::mem::size_of::<u32>();

/// Splits an import path `package.module:Qual.Name` into `(module, qualname)`: the one place
/// Rust reads one, the same way the Python side's one reading (`troupe._support.split_target`)
/// does: at the first `:`, both parts non-empty. `None` when `target` is not such a path.
pub fn split_target(target: &str) -> Option<(&str, &str)> {
    target
        .split_once(':')
        .filter(|(module, qualname)| !module.is_empty() && !qualname.is_empty())
}

/// What to build: the first frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// `package.module:QualName` (see [`split_target`]).
    pub target: String,
    /// The controller's `__main__` file, when the class lives there.
    pub main_file: Option<String>,
    /// Entries to put first on `sys.path`.
    pub sys_path: Vec<String>,
    /// Encoded `(args, kwargs)` of the constructor.
    #[serde(with = "serde_bytes")]
    pub init: Vec<u8>,
}

/// One call as a caller makes it (also the `troupe.python` actor's message, `PyCall`); the
/// actor numbers it into a [`Call`] for the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// Method name.
    pub method: String,
    /// Encoded `(args, kwargs)`.
    #[serde(with = "serde_bytes")]
    pub args: Vec<u8>,
}

/// One call on the socket: a [`Request`] with the id its [`Answer`] will carry. Borrowed, so
/// a call's arguments are not copied on their way to the worker.
#[derive(Debug, Clone, Serialize)]
pub struct Call<'a> {
    /// Unique among the calls in flight to one worker.
    pub id: u64,
    /// Method name.
    pub method: &'a str,
    /// Encoded `(args, kwargs)`.
    #[serde(with = "serde_bytes")]
    pub args: &'a [u8],
}

/// The worker's answer to the [`Call`] with the same `id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    /// The call's id.
    pub id: u64,
    /// How it ended.
    pub reply: Reply,
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

/// The worker's answer to [`Hello`] (`Ok` with no bytes), or an [`Answer`]'s outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Done; the encoded result.
    Ok(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The call (or the import / constructor) raised.
    Raised(Raised),
}

/// Writes one frame, its length and body in one write: the worker reads the length first, and a
/// length that arrived alone would wake it twice per call. `s` is the socket or its write half
/// (the actor writes calls while another task reads answers).
pub async fn write_frame<T: Serialize>(
    s: &mut (impl AsyncWrite + Unpin),
    v: &T,
) -> std::io::Result<()> {
    let mut frame = vec![0u8; LENGTH_BYTES];
    rmp_serde::encode::write_named(&mut frame, v).map_err(std::io::Error::other)?;
    let body = frame.len() - LENGTH_BYTES;
    let len = u32::try_from(body)
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME)
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "a frame of {body} bytes exceeds the limit of {MAX_FRAME}"
            ))
        })?;
    frame[..LENGTH_BYTES].copy_from_slice(&len.to_le_bytes());
    s.write_all(&frame).await?;
    s.flush().await
}

/// Reads one frame; EOF, an oversized length or a bad body is an error. `s` is the socket or
/// its read half.
pub async fn read_frame<T: DeserializeOwned>(
    s: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<T> {
    let mut len = [0u8; LENGTH_BYTES];
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
    use std::collections::BTreeMap;

    use tokio::net::UnixStream;

    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bad_frames_are_refused() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let call = Call {
            id: 7,
            method: "train_batch",
            args: &[0, 1, 255],
        };
        write_frame(&mut a, &call).await.unwrap();
        // What the Python worker reads: a map with the call's fields, the arguments as bytes.
        #[derive(Deserialize)]
        struct Seen {
            id: u64,
            method: String,
            #[serde(with = "serde_bytes")]
            args: Vec<u8>,
        }
        let got: Seen = read_frame(&mut b).await.unwrap();
        assert_eq!(
            (got.id, got.method.as_str(), got.args.as_slice()),
            (7, "train_batch", &[0u8, 1, 255][..])
        );

        // What the Python worker writes: {"id": 7, "reply": {"Raised": {...}}}.
        let raised = Answer {
            id: 7,
            reply: Reply::Raised(Raised {
                kind: "ValueError".into(),
                message: "bad".into(),
                traceback: "Traceback ...".into(),
            }),
        };
        write_frame(&mut b, &raised).await.unwrap();
        match read_frame::<Answer>(&mut a).await.unwrap() {
            Answer {
                id: 7,
                reply: Reply::Raised(r),
            } => assert_eq!(r.kind, "ValueError"),
            other => panic!("expected call 7 raised, got {other:?}"),
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

    #[test]
    fn import_paths_split_at_the_first_colon_with_both_parts() {
        assert_eq!(split_target("pkg.mod:A.B"), Some(("pkg.mod", "A.B")));
        assert_eq!(split_target("__main__:W"), Some(("__main__", "W")));
        for bad in ["", "pkg.mod", ":A", "pkg:", "not a path"] {
            assert_eq!(split_target(bad), None, "{bad:?}");
        }
    }

    /// The keys of `v` as MessagePack writes it (a map with named fields).
    fn keys<T: Serialize>(v: &T) -> Vec<String> {
        let mut body = Vec::new();
        rmp_serde::encode::write_named(&mut body, v).unwrap();
        let map: BTreeMap<String, serde::de::IgnoredAny> = rmp_serde::from_slice(&body).unwrap();
        map.into_keys().collect()
    }

    /// What `python/troupe/_frames.py` must hold, name by name, derived from the Rust side: the
    /// constants above, and every field name of every frame (Python's constant for a field is
    /// its name in capitals).
    fn expected_python_constants() -> BTreeMap<String, String> {
        // struct's spelling of what write_frame writes: a little-endian u32.
        const _: () = assert!(LENGTH_BYTES == 4);
        let mut want = BTreeMap::from([
            ("FD_ENV".to_string(), format!("{FD_ENV:?}")),
            ("LENGTH_FORMAT".to_string(), "\"<I\"".to_string()),
            ("MAX_FRAME".to_string(), MAX_FRAME.to_string()),
        ]);
        let raised = Raised {
            kind: String::new(),
            message: String::new(),
            traceback: String::new(),
        };
        let hello = Hello {
            target: String::new(),
            main_file: None,
            sys_path: Vec::new(),
            init: Vec::new(),
        };
        let call = Call {
            id: 0,
            method: "",
            args: &[],
        };
        let answer = Answer {
            id: 0,
            reply: Reply::Ok(Vec::new()),
        };
        let fields = [
            keys(&hello),
            keys(&call),
            keys(&answer),
            keys(&Reply::Ok(Vec::new())),
            keys(&Reply::Raised(raised.clone())),
            keys(&raised),
        ];
        for name in fields.into_iter().flatten() {
            want.insert(name.to_uppercase(), format!("{name:?}"));
        }
        want
    }

    /// `NAME = value` per line of a constants-only Python module (values as written); a line
    /// that is anything else (outside the docstring and comments) is an error.
    fn python_constants(text: &str) -> Result<BTreeMap<String, String>, String> {
        let mut out = BTreeMap::new();
        let mut in_docstring = false;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end();
            let quotes = line.matches("\"\"\"").count();
            if in_docstring || quotes > 0 {
                in_docstring ^= quotes % 2 == 1;
                continue;
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, value) = line
                .split_once(" = ")
                .filter(|(n, _)| n.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
                .ok_or_else(|| format!("line {}: not a constant: {line:?}", i + 1))?;
            let value = value.split(" #").next().unwrap_or(value).trim();
            let quoted = value.len() >= 2 && value.starts_with('"') && value.ends_with('"');
            if !quoted && value.parse::<u64>().is_err() {
                return Err(format!(
                    "line {}: not a string or integer: {value:?}",
                    i + 1
                ));
            }
            if out.insert(name.to_string(), value.to_string()).is_some() {
                return Err(format!("line {}: {name} is set twice", i + 1));
            }
        }
        Ok(out)
    }

    #[test]
    fn python_frames_match_the_rust_ones() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/troupe/_frames.py");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let got = python_constants(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let want = expected_python_constants();
        let differ: Vec<String> = got
            .keys()
            .chain(want.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|name| got.get(*name) != want.get(*name))
            .map(|name| {
                let show = |v: Option<&String>| v.map_or("(missing)".to_string(), String::clone);
                format!(
                    "{name}: Python {}, Rust {}",
                    show(got.get(name)),
                    show(want.get(name))
                )
            })
            .collect();
        assert!(
            differ.is_empty(),
            "{} disagrees with python_wire.rs:\n{}",
            path.display(),
            differ.join("\n")
        );
    }

    #[test]
    fn the_python_constants_reader_refuses_logic() {
        let ok = "\"\"\"Doc.\n\nMore = doc.\n\"\"\"\n# c\nA_B = \"x\"  # why\nN = 12\n";
        let got = python_constants(ok).unwrap();
        assert_eq!(got["A_B"], "\"x\"");
        assert_eq!(got["N"], "12");
        for bad in [
            "import os\n",
            "A = 1 << 2\n",
            "A = 1\nA = 2\n",
            "def f(): pass\n",
        ] {
            assert!(python_constants(bad).is_err(), "{bad:?}");
        }
    }
}
