//! The argument list's cache file, read and written under the rules a config file is read by
//! (issue 49): whatever sits at its predictable path may have been put there by someone else,
//! so it is read only when it is a regular file this user owns that nobody else may write,
//! within a size bound, and it is replaced whole, private to the user.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::OFlag;

/// Why a cache file was not read or not kept (logged; the list is then generated again).
#[derive(Debug, thiserror::Error)]
pub(super) enum CacheFileError {
    /// Opening failed (a symbolic link is refused here: `O_NOFOLLOW`).
    #[error("cannot open {path}: {source}")]
    Open {
        /// The cache file.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A FIFO, device, directory or symbolic link: reading it could hang or never end.
    #[error("{path} is {kind}, not a regular file")]
    NotRegular {
        /// The cache file.
        path: String,
        /// What it is instead.
        kind: &'static str,
    },
    /// Another user's file: its content is theirs to choose.
    #[error("{path} is owned by uid {owner}, not by this user (uid {me})")]
    NotOwned {
        /// The cache file.
        path: String,
        /// Its owner.
        owner: u32,
        /// This process's effective user.
        me: u32,
    },
    /// Writable by its group or by everyone: anyone of them may have changed it.
    #[error("{path} is writable by its group or by others (mode {mode:o})")]
    Writable {
        /// The cache file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// Larger than any list vLLM has (or a device that never ends).
    #[error("{path} is larger than {cap} bytes")]
    TooLarge {
        /// The cache file.
        path: String,
        /// The bound.
        cap: u64,
    },
    /// Reading or writing failed (not UTF-8, disk full, ...).
    #[error("cannot use {path}: {source}")]
    Io {
        /// The cache file.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
}

/// What a file that is not a regular file is, for the message.
fn kind(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The text of `path` when it is a regular file this user owns, that its group and others
/// cannot write, of at most `cap` bytes; `None` when there is no file. Never blocks on a FIFO
/// (opened non-blocking, its type checked on the opened descriptor before any read) and never
/// follows a symbolic link (`O_NOFOLLOW`), so what is checked is what is read.
pub(super) fn read_private(path: &Path, cap: u64) -> Result<Option<String>, CacheFileError> {
    let p = || path.display().to_string();
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            // ELOOP: the last component is a symbolic link; say so rather than "too many
            // levels of symbolic links".
            if let Ok(m) = std::fs::symlink_metadata(path)
                && !m.is_file()
            {
                return Err(CacheFileError::NotRegular {
                    path: p(),
                    kind: kind(m.file_type()),
                });
            }
            return Err(CacheFileError::Open { path: p(), source });
        }
    };
    let meta = file
        .metadata()
        .map_err(|source| CacheFileError::Io { path: p(), source })?;
    if !meta.is_file() {
        return Err(CacheFileError::NotRegular {
            path: p(),
            kind: kind(meta.file_type()),
        });
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(CacheFileError::NotOwned {
            path: p(),
            owner: meta.uid(),
            me,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(CacheFileError::Writable { path: p(), mode });
    }
    if meta.len() > cap {
        return Err(CacheFileError::TooLarge { path: p(), cap });
    }
    // Bounded even so: the file may grow between the check and the read.
    let mut text = String::new();
    file.take(cap + 1)
        .read_to_string(&mut text)
        .map_err(|source| CacheFileError::Io { path: p(), source })?;
    if text.len() as u64 > cap {
        return Err(CacheFileError::TooLarge { path: p(), cap });
    }
    Ok(Some(text))
}

/// Writes `text` to `path` whole or not at all, readable and writable by this user only: a new
/// temporary file (`O_EXCL`, mode 0600) in the same directory renamed over it, so two
/// deployments generating at once never read half a list, and whatever was at `path` (a FIFO,
/// a symbolic link, another user's file) is replaced, never written through. The directory is
/// made private (0700) when it has to be created.
pub(super) fn write_private(path: &Path, text: &str) -> Result<(), CacheFileError> {
    use std::io::Write;
    let io = |source| CacheFileError::Io {
        path: path.display().to_string(),
        source,
    };
    let dir = path
        .parent()
        .ok_or_else(|| io(std::io::Error::other("no directory")))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io)?;
    let tmp = dir.join(format!(
        ".{}.{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}
