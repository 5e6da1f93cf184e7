//! `vllm.*` keys follow the installed vLLM: a config whose vLLM components run another version
//! than the pin is checked against that version's own argument list, generated once and kept
//! in the cache. The interpreter here is a test double (a shell script) that answers the version
//! probe and the generator the way a venv with that vLLM would.

use std::path::Path;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// A fake interpreter: `-c PROBE` prints `version`; `- vllm` (the generator on standard input)
/// prints a list with `brand_new_flag`, and appends a line to `calls` each time it runs.
fn fake_python(dir: &Path, version: &str, generator_works: bool) -> String {
    let py = dir.join(format!("python-{version}-{generator_works}"));
    let calls = dir.join("generated");
    let body = if generator_works {
        format!(
            "cat > /dev/null\necho run >> '{}'\nprintf '# vllm {version}: field, flag, kind\\nbrand_new_flag\\t--brand-new-flag\\tvalue\\nenforce_eager\\t--enforce-eager\\ttrue\\n'\n",
            calls.display()
        )
    } else {
        "cat > /dev/null\necho 'ImportError: no vllm' >&2\nexit 1\n".to_string()
    };
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then\n  echo '{version}'\n  exit 0\nfi\n{body}"
    );
    std::fs::write(&py, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    py.display().to_string()
}

fn plan(dir: &Path, python: &str, key: &str) -> std::process::Output {
    let cfg = dir.join(format!("{key}.yaml"));
    std::fs::write(
        &cfg,
        format!("allocation_mode: \"vllm:d1t1\"\nvllm:\n  python: \"{python}\"\n  {key}: 3\n"),
    )
    .unwrap();
    std::process::Command::new(BIN)
        .arg("plan")
        .arg(&cfg)
        .env("TROUPE_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap()
}

#[test]
fn another_vllm_version_is_checked_against_its_own_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let py = fake_python(dir.path(), "9.9.9", true);
    let out = plan(dir.path(), &py, "brand_new_flag");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("--brand-new-flag 3"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A flag that version does not have is refused naming that version.
    let out = plan(dir.path(), &py, "max_num_seqs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("vllm.max_num_seqs") && err.contains("vllm 9.9.9"),
        "{err}"
    );
    // The list was generated once; the second plan read it from the cache.
    let runs = std::fs::read_to_string(dir.path().join("generated")).unwrap();
    assert_eq!(runs.lines().count(), 1, "{runs}");
}

#[test]
fn the_pinned_version_or_an_unreadable_list_keeps_the_pinned_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let pinned = fake_python(dir.path(), "0.32.0", true);
    let broken = fake_python(dir.path(), "9.9.8", false);
    for py in [&pinned, &broken] {
        let out = plan(dir.path(), py, "max_num_seqs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = plan(dir.path(), py, "brand_new_flag");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("vllm 0.32.0"),
            "{err}"
        );
    }
    assert!(
        !dir.path().join("generated").exists(),
        "the pinned version needs no list"
    );
}
