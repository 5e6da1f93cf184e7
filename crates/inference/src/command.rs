//! Building a server's command line: one place, one three-way branch on the worker type.
//!
//! SGLang's and the reference engine's flags are spelled the same on purpose, so the PD branch
//! is shared; vLLM differs in names and has no PD mode here.
//!
//! Secrets stay off the command line, which every user of the machine can read (`ps`,
//! `/proc/PID/cmdline`):
//! - the reference engine gets its admin key in [`ADMIN_KEY_ENV`] (`troupe engine` reads
//!   `--admin-api-key` from it);
//! - SGLang gets it in a YAML file, mode 0600 in the run directory, passed as `--config FILE`:
//!   SGLang 0.5's `prepare_server_args` turns each `key: value` of that file into `--key value`
//!   ahead of the other flags, so the key is spelled as the flag, `admin-api-key` (an
//!   underscore spelling would become the unknown flag `--admin_api_key`);
//! - vLLM has no admin key (only `--api-key`, which Troupe does not set), so nothing is passed.
//!
//! vLLM servers get `VLLM_SERVER_DEV_MODE=1` and `--enable-scale-out`: without them the
//! control routes and the token route Troupe's gateway sends to vLLM do not exist.
//!
//! The control-plane token (`TROUPE_TOKEN`) never reaches an engine: a spec that sets it is
//! refused, and [`command`] removes it from the inherited environment.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::spec::{Backend, LaunchSpec, WorkerType};

use troupe_actors::auth::TOKEN_ENV;
use troupe_wire::env::ENGINE_ADMIN_KEY as ADMIN_KEY_ENV;

/// The variable that turns on vLLM's development routes (vLLM 0.32: `vllm/envs.py`).
pub const VLLM_DEV_MODE: &str = "VLLM_SERVER_DEV_MODE";

/// A file the server reads at start that holds a secret: written mode 0600 before launch.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretFile {
    /// Where it goes (inside the run directory).
    pub path: PathBuf,
    /// What it holds.
    pub contents: String,
}

impl std::fmt::Debug for SecretFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// A program, its arguments, extra environment and the private files it reads.
#[derive(Clone, PartialEq, Eq)]
pub struct CommandLine {
    /// Executable.
    pub program: String,
    /// Arguments (never a secret).
    pub args: Vec<String>,
    /// Extra environment variables (may hold the admin key: not logged).
    pub env: BTreeMap<String, String>,
    /// Files to write (mode 0600) before launching.
    pub files: Vec<SecretFile>,
}

impl std::fmt::Debug for CommandLine {
    /// Names the environment variables without their values (one may be the admin key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandLine")
            .field("program", &self.program)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("files", &self.files)
            .finish()
    }
}

impl CommandLine {
    /// The value following `flag`, if present (for tests and logs).
    pub fn flag(&self, flag: &str) -> Option<&str> {
        let i = self.args.iter().position(|a| a == flag)?;
        self.args.get(i + 1).map(String::as_str)
    }

    /// Whether `flag` is present.
    pub fn has(&self, flag: &str) -> bool {
        self.args.iter().any(|a| a == flag)
    }
}

/// FP8 block-wise quantization config in the form SGLang reads from
/// `--json-model-override-args` (DeepSeek / Hugging Face convention).
pub fn fp8_override_json() -> String {
    serde_json::json!({
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]
        }
    })
    .to_string()
}

/// Why a spec cannot be launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

/// SGLang's config file for `key`: one `admin-api-key` entry, the value a YAML double-quoted
/// scalar with everything outside printable ASCII escaped (so no key can break the YAML or
/// depend on the reader's locale).
pub fn sglang_admin_config(key: &str) -> String {
    let mut v = String::with_capacity(key.len() + 2);
    for c in key.chars() {
        match c {
            '"' => v.push_str("\\\""),
            '\\' => v.push_str("\\\\"),
            ' '..='~' => v.push(c),
            c if (c as u32) <= 0xFFFF => v.push_str(&format!("\\u{:04X}", c as u32)),
            c => v.push_str(&format!("\\U{:08X}", c as u32)),
        }
    }
    format!(
        "# Written by Troupe for one SGLang server; read once at its start.\nadmin-api-key: \"{v}\"\n"
    )
}

/// Builds the command line for `spec`; files it needs (SGLang's private config) go in
/// `run_dir`.
pub fn build(
    spec: &LaunchSpec,
    troupe_bin: &str,
    run_dir: &Path,
) -> Result<CommandLine, SpecError> {
    if spec.tp == 0 || spec.pp == 0 {
        return Err(SpecError("tp and pp must be at least 1".into()));
    }
    if spec.env.contains_key(TOKEN_ENV) {
        return Err(SpecError(format!(
            "env sets {TOKEN_ENV}, the control plane's token; an engine must never hold it: remove it from the server's env"
        )));
    }
    let mut files = Vec::new();
    let mut a: Vec<String> = Vec::new();
    let push = |a: &mut Vec<String>, k: &str, v: String| {
        a.push(k.to_string());
        a.push(v);
    };
    let mut env = spec.env.clone();
    if !spec.gpus.is_empty() {
        let ids: Vec<String> = spec.gpus.iter().map(u32::to_string).collect();
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.join(","));
    }
    let program = match spec.backend {
        Backend::Sglang | Backend::Troupe => {
            let program = if spec.backend == Backend::Sglang {
                a.extend(["-m".into(), "sglang.launch_server".into()]);
                spec.python.clone()
            } else {
                a.push("engine".into());
                troupe_bin.to_string()
            };
            if spec.backend == Backend::Troupe && matches!(spec.model.as_str(), "tiny" | "small") {
                // The reference engine's built-in model sizes (seeded weights, no file).
                push(&mut a, "--model", spec.model.clone());
            } else {
                push(&mut a, "--model-path", spec.model.clone());
            }
            push(&mut a, "--host", spec.host.clone());
            push(&mut a, "--port", spec.port.to_string());
            push(&mut a, "--tp-size", spec.tp.to_string());
            if spec.pp > 1 {
                push(&mut a, "--pp-size", spec.pp.to_string());
            }
            // CUDA_VISIBLE_DEVICES already narrows the GPUs to the bundle: count from 0.
            push(&mut a, "--base-gpu-id", "0".into());
            if let Some(p) = spec.dist_port {
                push(&mut a, "--nccl-port", p.to_string());
            }
            if let Some(m) = &spec.multi_node {
                push(&mut a, "--dist-init-addr", m.dist_init_addr.clone());
                push(&mut a, "--nnodes", m.nnodes.to_string());
                push(&mut a, "--node-rank", m.node_rank.to_string());
            }
            match spec.worker_type {
                WorkerType::Regular => {}
                WorkerType::Train => {
                    return Err(SpecError(
                        "a training rank is not an inference server; launch regular, prefill or decode workers".into(),
                    ));
                }
                WorkerType::Prefill | WorkerType::Decode => {
                    push(
                        &mut a,
                        "--disaggregation-mode",
                        spec.worker_type.as_str().into(),
                    );
                    // The prefill serves KV on its bootstrap port; a decode learns each
                    // request's prefill address from the request (as SGLang's does).
                    match (spec.worker_type, spec.bootstrap_port) {
                        (WorkerType::Prefill, None) => {
                            return Err(SpecError(
                                "a prefill server needs its own bootstrap port".into(),
                            ));
                        }
                        (_, Some(port)) => {
                            push(&mut a, "--disaggregation-bootstrap-port", port.to_string())
                        }
                        (_, None) => {}
                    }
                    if let Some(t) = &spec.transfer_backend {
                        push(&mut a, "--disaggregation-transfer-backend", t.clone());
                    }
                }
            }
            if let Some(q) = &spec.quantization {
                push(&mut a, "--quantization", q.clone());
                if q == "fp8" {
                    push(&mut a, "--json-model-override-args", fp8_override_json());
                }
            }
            match (&spec.admin_api_key, spec.backend) {
                (None, _) => {}
                (Some(k), Backend::Troupe) => {
                    env.insert(ADMIN_KEY_ENV.into(), k.clone());
                }
                (Some(k), _) => {
                    if spec.extra_args.iter().any(|x| x == "--config") {
                        return Err(SpecError(
                            "extra_args has --config, but SGLang reads one config file and Troupe passes the admin key in it; give those options as flags in extra_args instead".into(),
                        ));
                    }
                    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
                    let path = run_dir.join(format!("sglang-{}-{suffix}.yaml", spec.port));
                    push(&mut a, "--config", path.display().to_string());
                    files.push(SecretFile {
                        path,
                        contents: sglang_admin_config(k),
                    });
                }
            }
            program
        }
        Backend::Fsdp | Backend::Megatron | Backend::Archon => {
            return Err(SpecError(format!(
                "{} is a training backend, not an inference server; use sglang, vllm or troupe",
                spec.backend
            )));
        }
        Backend::Vllm => {
            if spec.worker_type != WorkerType::Regular {
                return Err(SpecError(
                    "vLLM servers are launched as regular workers only; use sglang or troupe for prefill/decode groups".into(),
                ));
            }
            a.extend(["-m".into(), "vllm.entrypoints.openai.api_server".into()]);
            push(&mut a, "--model", spec.model.clone());
            push(&mut a, "--host", spec.host.clone());
            push(&mut a, "--port", spec.port.to_string());
            push(&mut a, "--tensor-parallel-size", spec.tp.to_string());
            push(&mut a, "--pipeline-parallel-size", spec.pp.to_string());
            if let Some(q) = &spec.quantization {
                push(&mut a, "--quantization", q.clone());
            }
            if let Some(p) = spec.dist_port {
                env.insert("VLLM_PORT".into(), p.to_string());
            }
            // The routes the control plane drives (pause, sleep, weight transfer,
            // collective_rpc, server info) exist only in vLLM's development mode, and the
            // gateway's `/inference/v1/generate` only with `--enable-scale-out`.
            env.entry(VLLM_DEV_MODE.into())
                .or_insert_with(|| "1".into());
            // vLLM's engine-core sockets (`ipc://$VLLM_RPC_BASE_PATH/<uuid>`) go in the run
            // directory, not loose in the temp dir: a killed server left them there, hundreds
            // after a day of test runs.
            if let Some(d) = rpc_base(run_dir) {
                env.entry(VLLM_RPC_BASE.into()).or_insert(d);
            }
            if spec.cpu {
                cpu_server(spec, run_dir, &mut env, &mut files);
            }
            if !spec
                .extra_args
                .iter()
                .any(|x| x == "--enable-scale-out" || x == "--no-enable-scale-out")
            {
                a.push("--enable-scale-out".into());
            }
            spec.python.clone()
        }
    };
    a.extend(spec.extra_args.iter().cloned());
    Ok(CommandLine {
        program,
        args: a,
        env,
        files,
    })
}

/// Where the AMX start-up call for vLLM's CPU servers lives (see the file's docstring).
const VLLM_SITECUSTOMIZE: &str = include_str!("vllm_site/sitecustomize.py");

/// A vLLM server on CPU cores: bound to its own cores (its placement slots), and every Python
/// process of it asks Linux for AMX tile state first (`vllm_site/sitecustomize.py`, put first on
/// its `PYTHONPATH`: vLLM's CPU attention dies with SIGILL otherwise on CPUs with AMX). Values
/// the config sets in `env` stand.
fn cpu_server(
    spec: &LaunchSpec,
    run_dir: &Path,
    env: &mut BTreeMap<String, String>,
    files: &mut Vec<SecretFile>,
) {
    env.remove("CUDA_VISIBLE_DEVICES");
    if !spec.gpus.is_empty() {
        let cores: Vec<String> = spec.gpus.iter().map(u32::to_string).collect();
        env.entry(VLLM_CPU_BIND.into())
            .or_insert_with(|| cores.join(","));
    }
    let site = run_dir.join(format!("vllm-site-{}", spec.port));
    let inherited = spec
        .env
        .get("PYTHONPATH")
        .cloned()
        .or_else(|| std::env::var("PYTHONPATH").ok())
        .filter(|p| !p.is_empty());
    let path = match inherited {
        Some(p) => format!("{}:{p}", site.display()),
        None => site.display().to_string(),
    };
    env.insert("PYTHONPATH".into(), path);
    files.push(SecretFile {
        path: site.join("sitecustomize.py"),
        contents: VLLM_SITECUSTOMIZE.to_string(),
    });
}

/// Where vLLM puts its engine-core IPC sockets (its default: the temp dir).
pub const VLLM_RPC_BASE: &str = "VLLM_RPC_BASE_PATH";

/// `run_dir` as vLLM's socket directory, when a socket path in it (the directory, `/`, a
/// 36-character uuid) fits the 107 bytes a Unix socket path may have; else `None` (vLLM's
/// default stands).
fn rpc_base(run_dir: &Path) -> Option<String> {
    let d = run_dir.to_str()?;
    (d.len() + 1 + 36 <= 107).then(|| d.to_string())
}

/// vLLM's CPU backend: the cores a server's OpenMP threads are bound to (`0`, `0,1`, `0-3`).
pub const VLLM_CPU_BIND: &str = "VLLM_CPU_OMP_THREADS_BIND";

/// Writes the private files `cl` reads at start (mode 0600, their directories created) and
/// returns their paths, for the caller to remove once the server is up or gone. Every start of a
/// server goes through this and [`build`]: the `troupe.inference` actor's, and the real-vLLM
/// tests', so a test server gets exactly what a launched one gets (e.g. the AMX start-up call).
pub fn write_files(cl: &CommandLine) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::with_capacity(cl.files.len());
    for f in &cl.files {
        if let Some(dir) = f.path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        super::rundir::write_private(&f.path, &f.contents)
            .map_err(|e| format!("cannot write {}: {e}", f.path.display()))?;
        written.push(f.path.clone());
    }
    Ok(written)
}

/// The process to spawn for `cl`: its program, arguments and extra environment. (The
/// control-plane token is taken out of every child's environment by
/// `troupe_actors::process::ChildProcess::spawn`, for engines and any other child alike.)
pub fn command(cl: &CommandLine) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&cl.program);
    cmd.args(&cl.args).envs(&cl.env);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::MultiNode;

    fn build(spec: &LaunchSpec, bin: &str) -> Result<CommandLine, SpecError> {
        super::build(spec, bin, Path::new("/run/troupe-test"))
    }

    fn spec(backend: Backend, wt: WorkerType) -> LaunchSpec {
        crate::spec::test_spec(backend, wt)
    }

    #[test]
    fn sglang_regular_has_no_pd_flags() {
        let c = build(&spec(Backend::Sglang, WorkerType::Regular), "troupe").unwrap();
        assert_eq!(c.program, "python3");
        assert_eq!(&c.args[..2], ["-m", "sglang.launch_server"]);
        assert_eq!(c.flag("--model-path"), Some("/models/qwen"));
        assert_eq!(c.flag("--tp-size"), Some("2"));
        assert_eq!(c.flag("--port"), Some("30000"));
        assert_eq!(c.flag("--nccl-port"), Some("30001"));
        assert_eq!(c.flag("--base-gpu-id"), Some("0"));
        assert_eq!(
            c.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
            Some("4,5")
        );
        assert!(!c.has("--disaggregation-mode"));
        assert!(!c.has("--disaggregation-bootstrap-port"));
        assert_eq!(c.flag("--mem-fraction-static"), Some("0.8"));
    }

    #[test]
    fn sglang_prefill_and_decode_each_get_mode_and_own_bootstrap_port() {
        for wt in [WorkerType::Prefill, WorkerType::Decode] {
            let c = build(&spec(Backend::Sglang, wt), "troupe").unwrap();
            assert_eq!(c.flag("--disaggregation-mode"), Some(wt.as_str()));
            assert_eq!(c.flag("--disaggregation-bootstrap-port"), Some("30002"));
            assert_eq!(
                c.flag("--disaggregation-transfer-backend"),
                Some("mooncake")
            );
        }
        let mut s = spec(Backend::Sglang, WorkerType::Prefill);
        s.bootstrap_port = None;
        assert!(
            build(&s, "troupe")
                .unwrap_err()
                .0
                .contains("bootstrap port")
        );
        // A decode needs none: it reads each request's prefill address.
        let mut d = spec(Backend::Sglang, WorkerType::Decode);
        d.bootstrap_port = None;
        assert!(
            !build(&d, "troupe")
                .unwrap()
                .has("--disaggregation-bootstrap-port")
        );
    }

    #[test]
    fn multi_node_and_fp8_flags() {
        let mut s = spec(Backend::Sglang, WorkerType::Regular);
        s.multi_node = Some(MultiNode {
            nnodes: 2,
            node_rank: 1,
            dist_init_addr: "10.0.0.1:5000".into(),
        });
        s.quantization = Some("fp8".into());
        let c = build(&s, "troupe").unwrap();
        assert_eq!(c.flag("--dist-init-addr"), Some("10.0.0.1:5000"));
        assert_eq!(c.flag("--nnodes"), Some("2"));
        assert_eq!(c.flag("--node-rank"), Some("1"));
        assert_eq!(c.flag("--quantization"), Some("fp8"));
        let j: serde_json::Value =
            serde_json::from_str(c.flag("--json-model-override-args").unwrap()).unwrap();
        assert_eq!(
            j["quantization_config"]["weight_block_size"],
            serde_json::json!([128, 128])
        );
        assert_eq!(j["quantization_config"]["fmt"], "e4m3");
    }

    #[test]
    fn troupe_backend_runs_troupe_engine_with_the_same_flags() {
        let c = build(&spec(Backend::Troupe, WorkerType::Decode), "/bin/troupe").unwrap();
        assert_eq!(c.program, "/bin/troupe");
        assert_eq!(c.args[0], "engine");
        assert_eq!(c.flag("--disaggregation-mode"), Some("decode"));
    }

    #[test]
    fn vllm_uses_its_own_flag_names_and_refuses_pd() {
        let c = build(&spec(Backend::Vllm, WorkerType::Regular), "troupe").unwrap();
        assert_eq!(&c.args[..2], ["-m", "vllm.entrypoints.openai.api_server"]);
        assert_eq!(c.flag("--model"), Some("/models/qwen"));
        assert_eq!(c.flag("--tensor-parallel-size"), Some("2"));
        assert!(!c.has("--tp-size"));
        assert!(build(&spec(Backend::Vllm, WorkerType::Prefill), "troupe").is_err());
        // The routes Troupe drives exist only in development mode and with scale-out.
        assert_eq!(c.env.get(VLLM_DEV_MODE).map(String::as_str), Some("1"));
        assert!(c.has("--enable-scale-out"));
        let mut s = spec(Backend::Vllm, WorkerType::Regular);
        s.extra_args.push("--no-enable-scale-out".into());
        s.env.insert(VLLM_DEV_MODE.into(), "0".into());
        let c = build(&s, "troupe").unwrap();
        assert!(!c.has("--enable-scale-out"), "the user's choice stands");
        assert_eq!(c.env.get(VLLM_DEV_MODE).map(String::as_str), Some("0"));
    }

    #[test]
    fn vllm_keeps_its_sockets_in_the_run_directory_when_their_paths_fit() {
        let c = build(&spec(Backend::Vllm, WorkerType::Regular), "troupe").unwrap();
        assert_eq!(c.env[VLLM_RPC_BASE], "/run/troupe-test");
        let mut s = spec(Backend::Vllm, WorkerType::Regular);
        s.env.insert(VLLM_RPC_BASE.into(), "/mine".into());
        assert_eq!(build(&s, "troupe").unwrap().env[VLLM_RPC_BASE], "/mine");
        let long = Path::new("/").join("d".repeat(80));
        assert_eq!(rpc_base(&long), None, "a socket path there would not fit");
        let sglang = build(&spec(Backend::Sglang, WorkerType::Regular), "troupe").unwrap();
        assert!(!sglang.env.contains_key(VLLM_RPC_BASE));
    }

    #[test]
    fn a_vllm_server_on_cpus_is_bound_to_its_cores_and_asks_for_amx() {
        let mut s = spec(Backend::Vllm, WorkerType::Regular);
        s.cpu = true;
        s.env.insert("PYTHONPATH".into(), "/mine".into());
        let c = build(&s, "troupe").unwrap();
        assert_eq!(c.env.get(VLLM_CPU_BIND).map(String::as_str), Some("4,5"));
        assert!(!c.env.contains_key("CUDA_VISIBLE_DEVICES"));
        let site = "/run/troupe-test/vllm-site-30000";
        assert_eq!(
            c.env.get("PYTHONPATH").map(String::as_str),
            Some(format!("{site}:/mine").as_str())
        );
        assert_eq!(c.files.len(), 1);
        assert_eq!(c.files[0].path, Path::new(site).join("sitecustomize.py"));
        assert!(c.files[0].contents.contains("ARCH_REQ_XCOMP_PERM"));
        // A GPU server gets none of it.
        let c = build(&spec(Backend::Vllm, WorkerType::Regular), "troupe").unwrap();
        assert!(!c.env.contains_key(VLLM_CPU_BIND) && c.files.is_empty());
        assert_eq!(
            c.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
            Some("4,5")
        );
    }

    #[test]
    fn admin_key_never_on_the_command_line() {
        let key = "s3cr3t-\"quoted\"\\-é";
        for backend in [Backend::Troupe, Backend::Sglang, Backend::Vllm] {
            let mut s = spec(backend, WorkerType::Regular);
            s.admin_api_key = Some(key.into());
            let c = build(&s, "/bin/troupe").unwrap();
            assert!(!c.has("--admin-api-key"), "{backend}: {:?}", c.args);
            assert!(
                c.args.iter().all(|a| !a.contains("s3cr3t")),
                "{backend}: {:?}",
                c.args
            );
            assert!(!format!("{c:?}").contains("s3cr3t"), "Debug hides the key");
        }

        let mut s = spec(Backend::Troupe, WorkerType::Decode);
        s.admin_api_key = Some(key.into());
        let c = build(&s, "/bin/troupe").unwrap();
        assert_eq!(c.env.get(ADMIN_KEY_ENV).map(String::as_str), Some(key));
        assert!(c.files.is_empty());

        let mut s = spec(Backend::Sglang, WorkerType::Prefill);
        s.admin_api_key = Some(key.into());
        let c = build(&s, "troupe").unwrap();
        assert!(!c.env.contains_key(ADMIN_KEY_ENV));
        let path = c.flag("--config").expect("--config FILE");
        assert!(path.starts_with("/run/troupe-test/sglang-30000-"), "{path}");
        assert!(
            path.ends_with(".yaml"),
            "SGLang only reads .yaml/.yml: {path}"
        );
        assert_eq!(c.files.len(), 1);
        assert_eq!(c.files[0].path, Path::new(path));
        assert_eq!(
            c.files[0].contents.lines().last(),
            Some(r#"admin-api-key: "s3cr3t-\"quoted\"\\-\u00E9""#)
        );

        s.extra_args
            .extend(["--config".into(), "/etc/mine.yaml".into()]);
        assert!(build(&s, "troupe").unwrap_err().0.contains("--config"));
        s.admin_api_key = None;
        let c = build(&s, "troupe").unwrap();
        assert_eq!(
            c.flag("--config"),
            Some("/etc/mine.yaml"),
            "no key: untouched"
        );
        assert!(c.files.is_empty());
    }

    #[test]
    fn the_control_plane_token_never_reaches_an_engine() {
        let mut s = spec(Backend::Troupe, WorkerType::Regular);
        s.env.insert("HF_HOME".into(), "/hf".into());
        let c = build(&s, "/bin/troupe").unwrap();
        let cmd = command(&c);
        let envs: Vec<(String, Option<String>)> = cmd
            .as_std()
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        assert!(envs.contains(&("HF_HOME".to_string(), Some("/hf".to_string()))));
        assert_eq!(cmd.as_std().get_program(), "/bin/troupe");

        s.env.insert(TOKEN_ENV.into(), "leaked".into());
        assert!(build(&s, "/bin/troupe").unwrap_err().0.contains(TOKEN_ENV));
    }
}
