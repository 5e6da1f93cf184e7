//! The run directory: where this process's inference servers keep their logs and their
//! private config files.
//!
//! Logs used to go to `$TMPDIR/troupe-NAME-ID.log`, readable by every user of the machine (an
//! engine's log holds prompts, paths and errors) and piling up across runs with nothing to say
//! which run wrote them. Now each process (one `troupe host`, one `troupe serve`) creates one
//! directory, once, `$TMPDIR/troupe-run-PID-RANDOM`, mode 0700, and puts every server's log
//! (opened mode 0600 by `ChildProcess::spawn`) and config file (mode 0600, [`write_private`])
//! in it. `LaunchSpec::log_path` still overrides a server's log file.
//!
//! The directory is removed when its process ends cleanly ([`finish`], called by the `troupe`
//! binary as every command returns) unless a server in it failed ([`keep`]: it died, exited
//! during start-up, or never became ready) or the command itself failed: a failed run's logs
//! are what an operator reads first, and then their place is printed. A process that could not
//! finish (killed, or a test binary, which never calls [`finish`]) leaves its directory
//! behind; the next run directory made under the same parent removes those that are empty and
//! whose process is gone ([`sweep`]), so they do not pile up, and never one that holds a log.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// Prefix of every run directory's name.
pub const PREFIX: &str = "troupe-run-";

/// Creates a fresh run directory under `parent`: `troupe-run-PID-RANDOM`, mode 0700. A name
/// that already exists (left by a process with a recycled pid, or planted) is never reused.
pub fn create(parent: &Path) -> std::io::Result<PathBuf> {
    let mut last = None;
    for _ in 0..16 {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let dir = parent.join(format!("{PREFIX}{}-{suffix}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                sweep(parent, &dir);
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free run directory name")))
}

/// Most entries of the parent [`sweep`] looks at: a temp dir with a million files costs a
/// bounded scan, not a stall.
const SWEEP_MAX_ENTRIES: usize = 4096;

/// Removes the run directories under `parent` left by processes that are gone, when they are
/// empty and belong to the user who owns `ours` (the directory just made). `remove_dir`
/// removes only an empty directory, so a failed run's kept logs are never touched, and a
/// directory whose process is still alive (its pid in `/proc`) is not even tried.
fn sweep(parent: &Path, ours: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(me) = std::fs::metadata(ours).map(|m| m.uid()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.take(SWEEP_MAX_ENTRIES).flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let path = e.path();
        if path == ours
            || Path::new(&format!("/proc/{pid}")).exists()
            || !e.metadata().is_ok_and(|m| m.is_dir() && m.uid() == me)
        {
            continue;
        }
        // Fails (and is left) when it holds anything.
        let _ = std::fs::remove_dir(&path);
    }
}

/// This process's run directory, once created.
static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// A server in this process's run directory failed: keep its logs.
static KEEP: AtomicBool = AtomicBool::new(false);

/// Keeps the run directory when this process ends (a server failed; its log explains why).
pub fn keep() {
    KEEP.store(true, Ordering::Relaxed);
}

/// At the end of the process: removes its run directory if it made one and nothing failed
/// (`ok`: the command itself succeeded), else says where the logs are kept. Returns the kept
/// directory, if any.
pub fn finish(ok: bool) -> Option<PathBuf> {
    let dir = DIR.get()?.as_ref().ok()?;
    if ok && !KEEP.load(Ordering::Relaxed) {
        if let Err(e) = std::fs::remove_dir_all(dir) {
            tracing::warn!("cannot remove the run directory {}: {e}", dir.display());
        }
        return None;
    }
    Some(dir.clone())
}

/// This process's run directory under the system temp dir, created on first use.
pub fn get() -> Result<&'static Path, String> {
    DIR.get_or_init(|| {
        let parent = std::env::temp_dir();
        create(&parent).map_err(|e| {
            format!(
                "cannot create a run directory for server logs in {}: {e}",
                parent.display()
            )
        })
    })
    .as_ref()
    .map(PathBuf::as_path)
    .map_err(Clone::clone)
}

/// A file name made of `name`'s safe characters (actor names may hold `/` or spaces).
pub fn file_stem(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes `contents` to a new file at `path` readable only by this user (mode 0600); refuses
/// to overwrite an existing file.
pub fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents.as_bytes())?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0)
    }

    #[test]
    fn run_directories_are_private_and_fresh() {
        let parent = std::env::temp_dir().join(format!(
            "troupe-rundir-test-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&parent).expect("parent");
        let a = create(&parent).expect("first");
        let b = create(&parent).expect("second");
        assert_ne!(a, b);
        assert_eq!(mode(&a), 0o700);
        let name = a.file_name().and_then(|n| n.to_str()).unwrap_or("");
        assert!(
            name.starts_with(&format!("{PREFIX}{}-", std::process::id())),
            "{name}"
        );
        let f = a.join("x.yaml");
        write_private(&f, "k: v\n").expect("write");
        assert_eq!(mode(&f), 0o600);
        assert_eq!(std::fs::read_to_string(&f).unwrap_or_default(), "k: v\n");
        assert!(write_private(&f, "again").is_err(), "never overwrites");
        std::fs::remove_dir_all(&parent).expect("cleanup");
    }

    #[test]
    fn empty_directories_of_gone_processes_are_swept_and_logs_kept() {
        let parent = std::env::temp_dir().join(format!(
            "troupe-rundir-test-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&parent).expect("parent");
        // A pid no process has: above the kernel's pid_max (at most 2^22).
        let gone = parent.join(format!("{PREFIX}{}-aaaaaaaaaaaa", 1u32 << 30));
        let kept = parent.join(format!("{PREFIX}{}-bbbbbbbbbbbb", 1u32 << 30));
        let alive = parent.join(format!("{PREFIX}{}-cccccccccccc", std::process::id()));
        let other = parent.join("troupe-run-notapid");
        for d in [&gone, &kept, &alive, &other] {
            std::fs::create_dir(d).expect("dir");
        }
        std::fs::write(kept.join("engine.log"), "why it failed").expect("log");
        let made = create(&parent).expect("create");
        assert!(
            !gone.exists(),
            "an empty directory of a gone process is removed"
        );
        assert!(kept.join("engine.log").exists(), "a kept log stays");
        assert!(alive.exists(), "a live process's directory stays");
        assert!(other.exists(), "a name that is not a run directory's stays");
        assert!(made.exists());
        std::fs::remove_dir_all(&parent).expect("cleanup");
    }

    #[test]
    fn one_run_directory_per_process() {
        let a = get().expect("run dir");
        assert_eq!(get().expect("run dir"), a);
        assert_eq!(mode(a), 0o700);
        assert!(a.starts_with(std::env::temp_dir()));
    }

    #[test]
    fn file_stems_are_safe() {
        assert_eq!(file_stem("dep/prefill 0"), "dep_prefill_0");
        assert_eq!(file_stem("decode-1.a_b"), "decode-1.a_b");
    }
}
