//! Reading a session directory back at start. Memory stays bounded: one record at a time (at
//! most [`frame::MAX_RECORD`] bytes), files past `max_sessions` are not read, and a session
//! past `max_session_tokens` stops being read. Nothing read panics: a torn tail (a write cut by
//! a crash) or a damaged record ends that file's session there, with a warning naming the file
//! and the offset; the damaged bytes are copied to `FILE.corrupt-OFFSET` and the file cut back
//! to its last good record, so later appends follow good records. A file whose first record is
//! not a session's opening is skipped whole, left as it is, with a warning.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use troupe_agent::{AgentError, Restored, SessionLimits};

use super::frame::{self, Next};
use super::record::{self, Record};

/// What a session directory held.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    /// The sessions, to restore.
    pub(crate) sessions: Vec<Restored>,
    /// Each session's file.
    pub(crate) files: HashMap<String, PathBuf>,
    /// What was skipped, and where.
    pub(crate) warnings: Vec<String>,
}

/// Reads every session file in `dir` (none when it does not exist yet). An error only when the
/// directory cannot be listed.
pub(crate) fn load(dir: &Path, limits: &SessionLimits) -> Result<Loaded, AgentError> {
    let mut out = Loaded::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(super::io(dir, "read the session directory", &e)),
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log") && p.is_file())
        .collect();
    paths.sort();
    for path in paths {
        if out.sessions.len() >= limits.max_sessions {
            out.warnings.push(format!(
                "{}: not read, {} sessions were read already (max_agent_sessions)",
                path.display(),
                limits.max_sessions
            ));
            continue;
        }
        match file(&path, limits, &mut out.warnings) {
            Ok(Some(s)) => {
                if out.files.contains_key(&s.id) {
                    out.warnings.push(format!(
                        "{}: session {} was read from another file already; this one is skipped",
                        path.display(),
                        s.id
                    ));
                    continue;
                }
                out.files.insert(s.id.clone(), path);
                out.sessions.push(s);
            }
            Ok(None) => {}
            Err(e) => out
                .warnings
                .push(format!("{}: cannot be read ({e}); skipped", path.display())),
        }
    }
    Ok(out)
}

/// One session file read back; `None` (with a warning) when it holds no session's opening.
fn file(
    path: &Path,
    limits: &SessionLimits,
    warnings: &mut Vec<String>,
) -> std::io::Result<Option<Restored>> {
    let mut r = BufReader::new(File::open(path)?);
    let mut offset: u64 = 0;
    let mut session: Option<Restored> = None;
    let mut tokens = 0usize;
    let damage = loop {
        let at = offset;
        let payload = match frame::next(&mut r)? {
            Next::Record(p) => p,
            Next::End => break None,
            Next::Torn => {
                break Some((
                    at,
                    "a record cut short (a write the gateway did not finish)".to_string(),
                ));
            }
            Next::Corrupt(why) => break Some((at, why)),
        };
        offset += 8 + payload.len() as u64;
        let rec: Record = match serde_json::from_slice(&payload) {
            Ok(r) => r,
            Err(e) => break Some((at, format!("a record that is not a session change ({e})"))),
        };
        let Some(s) = session.as_mut() else {
            match rec {
                Record::Open { v, id, key } if (1..=record::VERSION).contains(&v) => {
                    session = Some(Restored {
                        id,
                        key,
                        ..Default::default()
                    });
                    continue;
                }
                Record::Open { v, .. } => {
                    warnings.push(format!(
                        "{}: written by format version {v}, this gateway reads {}; skipped",
                        path.display(),
                        record::VERSION
                    ));
                    return Ok(None);
                }
                _ => {
                    warnings.push(format!(
                        "{}: offset 0 does not open a session; skipped",
                        path.display()
                    ));
                    return Ok(None);
                }
            }
        };
        let is_turn = matches!(rec, Record::Turn { .. });
        if let Err(why) = record::apply(s, rec) {
            break Some((at, why));
        }
        if is_turn {
            let t = s
                .turns
                .last()
                .map_or(0, |t| t.prompt_ids.len() + t.output_ids.len());
            tokens = tokens.saturating_add(t);
            if tokens > limits.max_session_tokens {
                s.turns.pop();
                break Some((
                    at,
                    format!(
                        "a turn past max_session_tokens {}",
                        limits.max_session_tokens
                    ),
                ));
            }
        }
    };
    let Some(s) = session else {
        warnings.push(format!(
            "{}: offset 0: {}; skipped",
            path.display(),
            damage.map_or_else(|| "empty".to_string(), |d| d.1)
        ));
        return Ok(None);
    };
    if let Some((at, why)) = damage {
        warnings.push(format!(
            "{}: offset {at}: {why}; session {} keeps the {} turns before it",
            path.display(),
            s.id,
            s.turns.len()
        ));
        set_aside(path, at)?;
    }
    Ok(Some(s))
}

/// Copies the bytes of `path` from `at` on to `PATH.corrupt-AT` and cuts the file there.
fn set_aside(path: &Path, at: u64) -> std::io::Result<()> {
    let mut f = OpenOptions::new().read(true).write(true).open(path)?;
    f.seek(SeekFrom::Start(at))?;
    let mut aside = File::create(path.with_extension(format!("log.corrupt-{at}")))?;
    std::io::copy(&mut f, &mut aside)?;
    f.set_len(at)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::super::{Journal, frame, record};
    use super::*;
    use serde_json::json;
    use troupe_agent::{SessionLog, Turn};

    fn turn(
        id: &str,
        msgs: Vec<serde_json::Value>,
        prompt: Vec<u32>,
        parent: Option<usize>,
    ) -> Turn {
        Turn::new(
            id.into(),
            msgs,
            json!({"role": "assistant", "content": "yo"}),
            ("P".repeat(prompt.len()), prompt),
            (
                "O".into(),
                vec![7, 8],
                vec![-0.5, f64::NEG_INFINITY],
                vec![json!("v1"); 2],
            ),
            json!({"type": "stop"}),
            json!({}),
            parent,
        )
    }

    struct Dir(PathBuf);

    impl Dir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn sessions_read_back_exactly_and_bad_records_are_named_not_parsed() {
        // A directory of this test's own (serving has no tempfile dependency).
        let root = std::env::temp_dir().join(format!("troupe-journal-{}", uuid::Uuid::new_v4()));
        let dir = Dir(root);
        let j = Journal::start(dir.path(), HashMap::new()).unwrap();
        j.opened("s1", "k1").unwrap();
        let u1 = json!({"role": "user", "content": "hi"});
        let t1 = turn("c1", vec![u1.clone()], vec![1, 2, 3], None);
        j.recorded("s1", &t1, None).unwrap();
        let msgs = vec![
            u1,
            t1.reply.clone(),
            json!({"role": "user", "content": "more"}),
        ];
        let t2 = turn("c2", msgs, vec![1, 2, 3, 7, 8, 9], Some(0));
        // The second turn's record leaves out what the first holds.
        match record::turn(&t2, Some(&t1)) {
            record::Record::Turn {
                turn,
                prompt_from,
                messages_from,
                ..
            } => {
                assert_eq!(
                    (turn.prompt_ids.to_vec(), prompt_from, messages_from),
                    (vec![9], 5, 2)
                );
            }
            r => panic!("{r:?}"),
        }
        j.recorded("s1", &t2, Some(&t1)).unwrap();
        j.rewarded("s1", Some("c1"), 1.5).unwrap();
        let limits = SessionLimits::default();
        let l = load(dir.path(), &limits).unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        let s = &l.sessions[0];
        assert_eq!(
            (s.id.as_str(), s.key.as_str(), s.turns.len()),
            ("s1", "k1", 2)
        );
        assert_eq!(s.turns[1].prompt_ids, t2.prompt_ids);
        assert_eq!(s.turns[1].prompt_text, t2.prompt_text);
        assert_eq!(s.turns[1].messages, t2.messages);
        assert_eq!(
            s.turns[1].output_logprobs, t2.output_logprobs,
            "-inf read back"
        );
        assert_eq!(s.rewards, vec![(Some("c1".to_string()), 1.5)]);
        // A record whose checksum holds but which names a parent never written: the session
        // keeps what came before it, the file and offset are named, nothing panics.
        let path = l.files["s1"].clone();
        let size = std::fs::metadata(&path).unwrap().len();
        let bad =
            serde_json::to_vec(&record::turn(&turn("c3", vec![], vec![], Some(9)), None)).unwrap();
        let mut bad_parent = serde_json::from_slice::<serde_json::Value>(&bad).unwrap();
        bad_parent["prompt_from"] = json!(4);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(
            &mut f,
            &frame::frame(&serde_json::to_vec(&bad_parent).unwrap()),
        )
        .unwrap();
        std::io::Write::write_all(&mut f, &frame::frame(b"{not json")).unwrap();
        let l = load(dir.path(), &limits).unwrap();
        assert_eq!(l.sessions[0].turns.len(), 2);
        assert!(
            l.warnings[0].contains(&format!("{}: offset {size}", path.display()))
                && l.warnings[0].contains("parent"),
            "{:?}",
            l.warnings
        );
        // The damaged tail was set aside: the file reads clean now.
        assert!(load(dir.path(), &limits).unwrap().warnings.is_empty());
        j.removed("s1");
        assert!(!path.exists());
    }

    #[test]
    fn bindings_read_back_as_last_written_and_format_versions_are_respected() {
        let dir =
            Dir(std::env::temp_dir().join(format!("troupe-journal-{}", uuid::Uuid::new_v4())));
        let j = Journal::start(dir.path(), HashMap::new()).unwrap();
        j.opened("s1", "k1").unwrap();
        let a = vec![("regular".to_string(), "http://a".to_string())];
        let b = vec![("regular".to_string(), "http://b".to_string())];
        j.bound("s1", &a).unwrap();
        j.recorded(
            "s1",
            &turn(
                "c1",
                vec![json!({"role": "user", "content": "hi"})],
                vec![1],
                None,
            ),
            None,
        )
        .unwrap();
        j.bound("s1", &b).unwrap();
        // A file of format version 1 (no bindings) is read as it is; one of a later version
        // is skipped whole and left on disk.
        let open = |v: u32, id: &str| {
            frame::frame(
                &serde_json::to_vec(&json!({"op": "open", "v": v, "id": id, "key": id})).unwrap(),
            )
        };
        std::fs::write(dir.path().join("old.log"), open(1, "s-old")).unwrap();
        std::fs::write(
            dir.path().join("new.log"),
            open(record::VERSION + 1, "s-new"),
        )
        .unwrap();
        let l = load(dir.path(), &SessionLimits::default()).unwrap();
        let by_id = |id: &str| l.sessions.iter().find(|s| s.id == id);
        assert_eq!(
            by_id("s1").map(|s| (s.bindings.clone(), s.turns.len())),
            Some((b, 1))
        );
        assert!(by_id("s-old").is_some_and(|s| s.bindings.is_empty()));
        assert!(by_id("s-new").is_none());
        assert!(
            l.warnings
                .iter()
                .any(|w| w.contains("new.log") && w.contains("format version")),
            "{:?}",
            l.warnings
        );
        assert!(dir.path().join("new.log").exists());
    }
}
