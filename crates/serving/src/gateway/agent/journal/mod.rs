//! Recorded sessions on disk, so a restarted gateway (or `troupe serve --recover`) continues
//! them: one append-only file per open session under the agent layer's `session_dir`, written
//! as the session changes and deleted once it is exported, finished or expired.
//!
//! Why files written by hand, not an embedded database: the data is write-once and read only
//! at start, every change appends to one session, and a finished session is dropped whole. A
//! file per session makes that an `unlink`, with no compaction and no tombstones; an embedded
//! store (redb, sled, fjall) would add a B-tree or LSM and its own compaction for nothing a
//! reader asks of it. The framing (`frame.rs`) finds torn or damaged records.
//!
//! Durability: each change is written (`write(2)`) before the store answers the client, so a
//! killed gateway (SIGKILL, a panic, OOM) loses nothing it answered; the files are `fsync`ed
//! in batches every [`SYNC_EVERY`] by a thread of their own, so a machine crash loses at most
//! that much. Cost per turn: one `open`+`write`+`close` of the turn's new tokens as JSON (a
//! turn extending the previous one writes only its new prompt tokens and its output), and a
//! share of one `fsync` per file per interval.

mod frame;
mod load;
mod record;

use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use troupe_agent::{AgentError, SessionLog, Turn};

pub(crate) use load::load;

/// How often written session files are `fsync`ed.
pub(crate) const SYNC_EVERY: Duration = Duration::from_millis(50);

/// The files of a session directory, written as sessions change.
#[derive(Debug)]
pub(crate) struct Journal {
    dir: PathBuf,
    /// Each open session's file.
    files: Mutex<HashMap<String, PathBuf>>,
    /// Files written since the last `fsync` (and whether the directory gained a file).
    dirty: Mutex<(HashSet<PathBuf>, bool)>,
}

impl Journal {
    /// A journal writing into `dir` (created if missing), whose sessions already on disk are
    /// `files` (id to file, from [`load`]); its `fsync` thread runs while it lives.
    pub(crate) fn start(
        dir: &Path,
        files: HashMap<String, PathBuf>,
    ) -> Result<Arc<Self>, AgentError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, "create the session directory", &e))?;
        let j = Arc::new(Self {
            dir: dir.to_path_buf(),
            files: Mutex::new(files),
            dirty: Mutex::default(),
        });
        let weak = Arc::downgrade(&j);
        std::thread::Builder::new()
            .name("troupe-session-sync".into())
            .spawn(move || sync_loop(weak))
            .map_err(|e| io(dir, "start the session sync thread", &e))?;
        Ok(j)
    }

    fn append(&self, id: &str, payload: &[u8]) -> Result<(), AgentError> {
        let path = self.files.lock().get(id).cloned().ok_or_else(|| {
            AgentError::NotFound(format!(
                "session {id} has no file in {}",
                self.dir.display()
            ))
        })?;
        let mut f = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, "open", &e))?;
        f.write_all(&frame::frame(payload))
            .map_err(|e| io(&path, "append to", &e))?;
        self.dirty.lock().0.insert(path);
        Ok(())
    }

    fn write(&self, id: &str, r: &record::Record) -> Result<(), AgentError> {
        let payload = serde_json::to_vec(r).map_err(|e| {
            AgentError::Config(format!("session {id}: cannot write its record: {e}"))
        })?;
        self.append(id, &payload)
    }

    fn sync(&self) {
        let (files, dir) = std::mem::take(&mut *self.dirty.lock());
        for p in files {
            // A file deleted since (its session exported) needs nothing.
            if let Ok(f) = std::fs::File::open(&p)
                && let Err(e) = f.sync_data()
            {
                tracing::warn!(file = %p.display(), error = %e, "cannot fsync a session file");
            }
        }
        if dir && let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
    }
}

fn sync_loop(j: Weak<Journal>) {
    loop {
        std::thread::sleep(SYNC_EVERY);
        match j.upgrade() {
            Some(j) => j.sync(),
            None => return,
        }
    }
}

fn io(path: &Path, what: &str, e: &std::io::Error) -> AgentError {
    AgentError::Storage(format!(
        "cannot {what} {}: {e} (the gateway's session_dir)",
        path.display()
    ))
}

impl SessionLog for Journal {
    fn opened(&self, id: &str, key: &str) -> Result<(), AgentError> {
        let path = self
            .dir
            .join(format!("{}.log", uuid::Uuid::new_v4().simple()));
        let payload = serde_json::to_vec(&record::Record::Open {
            v: record::VERSION,
            id: id.to_string(),
            key: key.to_string(),
        })
        .map_err(|e| AgentError::Config(format!("session {id}: {e}")))?;
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io(&path, "create", &e))?;
        f.write_all(&frame::frame(&payload))
            .map_err(|e| io(&path, "write", &e))?;
        self.files.lock().insert(id.to_string(), path.clone());
        let mut d = self.dirty.lock();
        d.0.insert(path);
        d.1 = true;
        Ok(())
    }

    fn recorded(&self, id: &str, turn: &Turn, parent: Option<&Turn>) -> Result<(), AgentError> {
        self.write(id, &record::turn(turn, parent))
    }

    fn rewarded(&self, id: &str, interaction: Option<&str>, reward: f64) -> Result<(), AgentError> {
        self.write(
            id,
            &record::Record::Reward {
                interaction: interaction.map(str::to_string),
                reward,
            },
        )
    }

    fn bound(&self, id: &str, bindings: &[(String, String)]) -> Result<(), AgentError> {
        self.write(
            id,
            &record::Record::Bound {
                bindings: bindings.to_vec(),
            },
        )
    }

    fn ended(&self, id: &str) -> Result<(), AgentError> {
        self.write(id, &record::Record::End)
    }

    fn removed(&self, id: &str) {
        let Some(path) = self.files.lock().remove(id) else {
            return;
        };
        self.dirty.lock().0.remove(&path);
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(file = %path.display(), error = %e, "cannot remove a finished session's file");
        }
    }
}

/// The agent layer `spec` describes, with its sessions kept in `spec.session_dir` when it
/// names one: the sessions found there are read back first (each file or record that cannot
/// be read is skipped with a warning naming the file and offset), then every change is
/// written there.
pub(crate) fn build(spec: &troupe_agent::AgentSpec) -> Result<troupe_agent::Agent, AgentError> {
    let agent = spec.build()?;
    let Some(dir) = &spec.session_dir else {
        return Ok(agent);
    };
    let loaded = load(dir, agent.sessions.limits())?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let n = loaded.sessions.len();
    let mut files = loaded.files;
    for (id, why) in agent.sessions.restore(loaded.sessions) {
        let file = files.remove(&id);
        tracing::warn!(session = %id, file = ?file, "recorded session not read back: {why}; its file is left as it is");
    }
    if n > 0 {
        tracing::info!(dir = %dir.display(), sessions = files.len(), "recorded sessions read back");
    }
    agent.sessions.attach(Journal::start(dir, files)?)?;
    Ok(agent)
}
