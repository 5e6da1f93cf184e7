//! The cache is not trusted (issue 49): a FIFO, a link to `/dev/zero`, a file others may write
//! or a list edited to change what a key means is ignored and the list generated again. The
//! interpreter is a test double (a shell script) answering the version probe and the generator
//! as a venv with vLLM 9.9.9 would.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{cache_name, checked, vllm_table_in};

/// A directory removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let d = std::env::temp_dir().join(format!("troupe-args-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(d.join("cache")).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const VERSION: &str = "9.9.9";

/// A fake interpreter whose generator prints a list with `brand_new_flag` and the real
/// `enforce_eager` (or fails, when `works` is false).
fn fake_python(dir: &Path, works: bool) -> String {
    let py = dir.join(format!("python-{works}"));
    let body = if works {
        format!(
            "cat > /dev/null\nprintf '# vllm {VERSION}: field, flag, kind\\nbrand_new_flag\\t--brand-new-flag\\tvalue\\nenforce_eager\\t--enforce-eager\\ttrue\\n'\n"
        )
    } else {
        "cat > /dev/null\nexit 1\n".to_string()
    };
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then\n  echo '{VERSION}'\n  exit 0\nfi\n{body}"
    );
    std::fs::write(&py, script).unwrap();
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    py.display().to_string()
}

/// `vllm_table_in` on another thread, failing the test if it has not answered in 60 s.
fn table_within(py: &str, cache: &Path) -> Option<troupe_wire::engine_args::ArgTable> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (py, cache) = (py.to_string(), cache.to_path_buf());
    std::thread::spawn(move || {
        let _ = tx.send(vllm_table_in(&py, Some(&cache)));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("reading the vLLM argument list hung")
}

fn flag_of(t: &troupe_wire::engine_args::ArgTable, field: &str) -> Option<String> {
    t.fields
        .iter()
        .find(|a| a.field == field)
        .map(|a| a.flag.clone())
}

/// The generator's list was used, and the cache now holds it in a private regular file.
fn regenerated(t: Option<troupe_wire::engine_args::ArgTable>, file: &Path) {
    let t = t.expect("the generated list");
    assert_eq!(
        flag_of(&t, "brand_new_flag").as_deref(),
        Some("--brand-new-flag")
    );
    assert_eq!(
        flag_of(&t, "enforce_eager").as_deref(),
        Some("--enforce-eager")
    );
    let m = std::fs::symlink_metadata(file).unwrap();
    assert!(m.is_file(), "the cache file was replaced by a regular file");
    assert_eq!(m.mode() & 0o777, 0o600, "the cache file is private");
}

#[test]
fn a_fifo_at_the_cache_path_does_not_hang_and_is_replaced() {
    let d = Dir::new();
    let py = fake_python(&d.0, true);
    let file = d.0.join("cache").join(cache_name(&py, VERSION));
    let made = std::process::Command::new("mkfifo")
        .arg(&file)
        .status()
        .unwrap();
    assert!(made.success());
    regenerated(table_within(&py, &d.0.join("cache")), &file);
}

#[test]
fn a_link_to_dev_zero_is_refused_and_replaced() {
    let d = Dir::new();
    let py = fake_python(&d.0, true);
    let file = d.0.join("cache").join(cache_name(&py, VERSION));
    std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
    regenerated(table_within(&py, &d.0.join("cache")), &file);
}

#[test]
fn a_file_others_may_write_is_ignored() {
    let d = Dir::new();
    let py = fake_python(&d.0, true);
    let file = d.0.join("cache").join(cache_name(&py, VERSION));
    // A well-formed list, but not the generator's: used only if the file were trusted.
    std::fs::write(
        &file,
        "# vllm 9.9.9: field, flag, kind\nonly_in_the_cache\t--only-in-the-cache\tvalue\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
    let t = table_within(&py, &d.0.join("cache"));
    assert!(
        t.as_ref()
            .is_some_and(|t| flag_of(t, "only_in_the_cache").is_none())
    );
    regenerated(t, &file);
}

#[test]
fn a_private_well_formed_list_is_read_from_the_cache() {
    let d = Dir::new();
    // The generator fails: only the cache can answer.
    let py = fake_python(&d.0, false);
    let file = d.0.join("cache").join(cache_name(&py, VERSION));
    std::fs::write(
        &file,
        "# vllm 9.9.9: field, flag, kind\nonly_in_the_cache\t--only-in-the-cache\tvalue\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let t = table_within(&py, &d.0.join("cache")).expect("the cached list");
    assert!(flag_of(&t, "only_in_the_cache").is_some());
}

#[test]
fn a_poisoned_list_is_not_used() {
    let d = Dir::new();
    let py = fake_python(&d.0, true);
    let file = d.0.join("cache").join(cache_name(&py, VERSION));
    std::fs::write(
        &file,
        "# vllm 9.9.9: field, flag, kind\nenforce_eager\t--trust-remote-code\ttrue\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    regenerated(table_within(&py, &d.0.join("cache")), &file);
}

#[test]
fn a_row_may_not_take_another_fields_flag() {
    let list = |rows: &str| checked(&format!("# vllm 9.9.9: field, flag, kind\n{rows}"));
    for rows in [
        // Another field's flag, spelled as vLLM's parser also takes it, or abbreviated.
        "enforce_eager\t--trust-remote-code\ttrue\n",
        "enforce_eager\t--trust_remote_code\ttrue\n",
        "enforce_eager\t--trust-remote\ttrue\n",
        // A flag of a field only this list has.
        "a\t--b\ttrue\nb\t--b-c\tvalue\n",
        // Not one argument, not a known kind, a field twice, not a list.
        "enforce_eager\t--enforce-eager --trust-remote-code\ttrue\n",
        "enforce_eager\t--enforce-eager=1\ttrue\n",
        "enforce_eager\t--enforce-eager\tmaybe\n",
        "enforce_eager\t--enforce-eager\ttrue\nenforce_eager\t--enforce-eager\ttrue\n",
        "enforce_eager\t--enforce-eager\ttrue\textra\n",
    ] {
        assert!(list(rows).is_err(), "{rows:?} was accepted");
    }
    assert!(checked("# sglang 1.0: field, flag, kind\nx\t--x\ttrue\n").is_err());
    assert!(checked(&"x".repeat(2 << 20)).is_err());
    // The generator's own renames pass: a flag no other field owns.
    let t =
        list("ep_join_mode\t--elastic-ep-join-mode\tvalue\nenforce_eager\t--enforce-eager\ttrue\n")
            .unwrap();
    assert_eq!(
        flag_of(&t, "ep_join_mode").as_deref(),
        Some("--elastic-ep-join-mode")
    );
    // The pinned list itself passes.
    let pinned = include_str!("../../../../wire/data/vllm-engine-args.tsv");
    assert!(checked(pinned).is_ok());
}
