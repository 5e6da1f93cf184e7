//! What an inference server process gets: its log in the private run directory, created mode
//! 0600; the reference engine's admin key in its environment, never on its command line; and
//! never the control plane's token, even when the launching process holds one.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use support::within;
use troupe_actors::auth::TOKEN_ENV;
use troupe_actors::process::ChildProcess;
use troupe_serving::inference::command;
use troupe_serving::inference::{LaunchSpec, rundir};
use troupe_wire::env::ENGINE_ADMIN_KEY as ADMIN_KEY_ENV;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .map(|m| m.permissions().mode() & 0o777)
        .unwrap_or(0)
}

#[tokio::test]
async fn a_server_gets_its_key_by_environment_a_private_log_and_no_token() {
    // SAFETY: this test binary runs this one test, before it starts any other thread.
    unsafe { std::env::set_var(TOKEN_ENV, "control-plane-token-999") };
    within(20, async {
        let dir = rundir::get().expect("run dir");
        assert_eq!(mode(dir), 0o700);
        // A stand-in for `troupe engine` that prints its arguments and environment.
        let bin = dir.join("fake-troupe.sh");
        std::fs::write(&bin, "#!/bin/sh\necho \"argv: $*\"\nenv\n").expect("script");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let spec: LaunchSpec = serde_json::from_value(serde_json::json!({
            "backend": "troupe", "worker_type": "regular", "model": "tiny", "tp": 1, "pp": 1,
            "gpus": [], "host": "127.0.0.1", "advertise_host": "127.0.0.1", "port": 1,
            "dist_port": null, "bootstrap_port": null, "transfer_backend": null,
            "multi_node": null, "quantization": null, "admin_api_key": "admin-key-123",
        }))
        .expect("spec");
        let cl = command::build(&spec, &bin.display().to_string(), dir).expect("command");
        let log = dir.join("fake-troupe.log");
        let mut child = ChildProcess::spawn(command::command(&cl), Some(&log)).expect("spawn");
        assert!(child.wait().await.expect("exit").success());
        assert_eq!(mode(&log), 0o600, "the log is readable by this user only");
        let out = std::fs::read_to_string(&log).expect("log");
        let argv = out.lines().find(|l| l.starts_with("argv:")).unwrap_or("");
        assert!(
            argv.contains("engine") && !argv.contains("admin-key-123"),
            "{argv}"
        );
        assert!(
            out.contains(&format!("{ADMIN_KEY_ENV}=admin-key-123")),
            "{out}"
        );
        assert!(!out.contains("control-plane-token-999"), "{out}");
        let _ = std::fs::remove_file(&log);
        let _ = std::fs::remove_file(&bin);
        let _ = std::fs::remove_dir(dir);
    })
    .await;
}
