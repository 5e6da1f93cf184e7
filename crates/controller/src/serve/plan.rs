//! `troupe plan`: everything `troupe serve` would launch, without starting anything.
//!
//! [`LaunchPlan::of`] renders a [`Prepared`] fork — the same placement, ports, launch specs
//! and command builder `fork_prepared` launches from — so the plan and the deployment cannot
//! disagree. Secrets (the admin key, the KV-handoff secret, a Hugging Face token) are shown as
//! `<secret>`; none is ever an argument (`troupe_wire::engine_args` refuses secret flags).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use troupe_scheduler::{AllocationPlan, HostResources, InstancePorts};
use troupe_serving::inference::{LaunchSpec, WorkerType, command};

use super::fork::Prepared;
use super::options::{ForkError, ForkOptions};

/// Environment variables whose values are never printed.
const SECRET_ENV: &[&str] = &[
    troupe_wire::env::BOOTSTRAP_SECRET,
    troupe_wire::env::ENGINE_ADMIN_KEY,
    troupe_wire::engine_args::HF_TOKEN_ENV,
];

/// One server as it would be launched.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedServer {
    /// The actor name (`prefill-c0g0i0n0`: component, group, instance, node rank).
    pub name: String,
    /// Host index.
    pub host: usize,
    /// The host's address.
    pub address: String,
    /// Regular, prefill or decode.
    pub worker_type: WorkerType,
    /// GPU ids on the host.
    pub gpus: Vec<u32>,
    /// HTTP, NCCL / dist-init and bootstrap ports.
    pub ports: InstancePorts,
    /// Program and arguments, exactly as launched.
    pub command: Vec<String>,
    /// Extra environment (`CUDA_VISIBLE_DEVICES`, ...; secrets as `<secret>`).
    pub env: BTreeMap<String, String>,
    /// Private files written before launch (paths only; under the host's run directory).
    pub files: Vec<String>,
    /// The server's URL: the backend of its data proxy (heads only).
    pub url: Option<String>,
}

/// One engine of the weight-update group.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedEngine {
    /// Its URL.
    pub url: String,
    /// Its first rank.
    pub rank_offset: u32,
    /// Ranks (GPUs) it covers.
    pub gpus: u32,
}

/// Everything `troupe serve` would do, up to the first launch.
#[derive(Debug, Clone, Serialize)]
pub struct LaunchPlan {
    /// The allocation mode as parsed.
    pub allocation_mode: String,
    /// Hosts and their GPUs.
    pub hosts: Vec<HostResources>,
    /// Why these hosts (the live cluster, or `cluster.n_nodes × n_gpus_per_node` as configured).
    pub hosts_from: String,
    /// Every inference server.
    pub servers: Vec<PlannedServer>,
    /// Training ranks' places (host, GPUs), if the mode has a trainer.
    pub train: Vec<(usize, Vec<u32>)>,
    /// The gateway's workers: each head's data proxy, by type, in front of its server.
    pub gateway_pd: bool,
    /// Weight-update group size (rank 0 + every engine GPU).
    pub world_size: u32,
    /// Every engine's rank offset.
    pub engines: Vec<PlannedEngine>,
    /// With Slurm: the sbatch script that would be submitted.
    pub sbatch: Option<String>,
}

impl LaunchPlan {
    /// The plan `prepared` describes; `troupe_bin` is the executable the hosts run.
    pub fn of(
        plan: &AllocationPlan,
        prepared: &Prepared,
        opts: &ForkOptions,
        troupe_bin: &str,
        hosts_from: &str,
    ) -> Result<LaunchPlan, ForkError> {
        let mut servers = Vec::new();
        for (p, name, spec) in prepared.launches(plan, opts) {
            servers.push(planned(&p, name, &spec, troupe_bin)?);
        }
        let mut engines = Vec::new();
        let mut next = 1u32;
        for s in servers.iter().filter(|s| s.url.is_some()) {
            let gpus = s.gpus.len().max(1) as u32;
            engines.push(PlannedEngine {
                url: s.url.clone().unwrap_or_default(),
                rank_offset: next,
                gpus,
            });
            next = next.saturating_add(gpus);
        }
        let train = prepared
            .placement
            .instances
            .iter()
            .filter(|p| p.worker_type == WorkerType::Train)
            .map(|p| (p.host, p.gpus.clone()))
            .collect();
        Ok(LaunchPlan {
            allocation_mode: plan.to_string(),
            hosts: prepared.hosts.clone(),
            hosts_from: hosts_from.to_string(),
            gateway_pd: servers.iter().any(|s| s.worker_type != WorkerType::Regular),
            servers,
            train,
            world_size: next,
            engines,
            sbatch: None,
        })
    }

    /// The human-readable form.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let mut line = |s: String| {
            o.push_str(&s);
            o.push('\n');
        };
        line(format!("allocation mode: {}", self.allocation_mode));
        line(format!("hosts ({}):", self.hosts_from));
        for h in &self.hosts {
            line(format!(
                "  host {}  {}  GPUs {:?}",
                h.index, h.address, h.gpu_ids
            ));
        }
        line(format!("servers ({}):", self.servers.len()));
        for s in &self.servers {
            line(format!(
                "  {}  host {} ({})  GPUs {:?}  ports http {} dist {} bootstrap {}",
                s.name,
                s.host,
                s.address,
                s.gpus,
                opt(s.ports.http),
                opt(s.ports.dist),
                opt(s.ports.bootstrap)
            ));
            line(format!("    command: {}", shell_words(&s.command)));
            if !s.env.is_empty() {
                let env: Vec<String> = s
                    .env
                    .iter()
                    .map(|(k, v)| format!("{}={}", shell_quote(k), shell_quote(v)))
                    .collect();
                line(format!("    env: {}", env.join(" ")));
            }
            if !s.files.is_empty() {
                line(format!("    files: {}", shell_words(&s.files)));
            }
            if let Some(u) = &s.url {
                line(format!("    data proxy -> {u}"));
            }
        }
        for (host, gpus) in &self.train {
            line(format!("training rank: host {host} GPUs {gpus:?}"));
        }
        line(format!(
            "gateway: {} workers ({}), one data proxy each",
            self.engines.len(),
            if self.gateway_pd {
                "prefill/decode pairs"
            } else {
                "regular"
            }
        ));
        line(format!("weight group: world size {}", self.world_size));
        for e in &self.engines {
            line(format!(
                "  rank {:>3}..{:<3} {}",
                e.rank_offset,
                e.rank_offset + e.gpus,
                e.url
            ));
        }
        if let Some(s) = &self.sbatch {
            line("sbatch script:".into());
            o.push_str(s);
        }
        o
    }
}

/// The run directory's placeholder in planned commands: the host's directory, known at launch.
const RUN_DIR: &str = "$RUN_DIR";

/// `words` as one shell line that reads back as exactly these words.
fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `word` as a POSIX shell reads it back as one word, so a value holding a space, a newline or
/// a quote cannot look like several arguments in the printed plan: unchanged when every
/// character is one a shell takes literally (`[A-Za-z0-9_@%+=:,./-]`), else in single quotes
/// (a `'` inside written `'\''`); `''` for an empty word. A leading `$RUN_DIR` (the run
/// directory's placeholder) stays a variable, `"$RUN_DIR"`, so the line runs with it set.
pub fn shell_quote(word: &str) -> String {
    fn plain(w: &str) -> String {
        let literal = |c: char| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c);
        if !w.is_empty() && w.chars().all(literal) {
            w.to_string()
        } else {
            format!("'{}'", w.replace('\'', r"'\''"))
        }
    }
    match word.strip_prefix(RUN_DIR) {
        Some("") => format!("\"{RUN_DIR}\""),
        Some(rest) => format!("\"{RUN_DIR}\"{}", plain(rest)),
        None => plain(word),
    }
}

fn opt(p: Option<u16>) -> String {
    p.map_or_else(|| "-".into(), |p| p.to_string())
}

fn planned(
    p: &troupe_scheduler::PlacedInstance,
    name: String,
    spec: &LaunchSpec,
    troupe_bin: &str,
) -> Result<PlannedServer, ForkError> {
    // What launching adds after asking the server's Python (Troupe's vLLM plugin).
    let mut spec = spec.clone();
    troupe_serving::inference::vllm_plugin::choose_backend(&mut spec);
    let spec = &spec;
    let cl = command::build(spec, troupe_bin, Path::new(RUN_DIR))
        .map_err(|e| ForkError::Placement(format!("{name}: {e}")))?;
    let env = cl
        .env
        .iter()
        .map(|(k, v)| {
            let v = if SECRET_ENV.contains(&k.as_str()) {
                "<secret>".to_string()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect();
    Ok(PlannedServer {
        name,
        host: p.host,
        address: p.address.clone(),
        worker_type: p.worker_type,
        gpus: p.gpus.clone(),
        ports: p.ports,
        command: std::iter::once(cl.program.clone())
            .chain(cl.args.iter().cloned())
            .collect(),
        env,
        files: cl
            .files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect(),
        url: spec.wait_ready.then(|| spec.url()),
    })
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    /// What `sh` reads back from the quoted words (each printed with a NUL after it).
    fn through_sh(words: &[&str]) -> Vec<String> {
        let line: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s\\0' {}", line.join(" ")))
            .env("RUN_DIR", "/run/x")
            .output()
            .expect("sh");
        assert!(out.status.success(), "{line:?}");
        String::from_utf8_lossy(&out.stdout)
            .split_terminator('\0')
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn quoted_words_read_back_as_the_same_words() {
        let words = [
            "--tokenizer-path",
            "a\nb",
            "two words",
            "it's \"quoted\"",
            "",
            "$HOME `x` $(y) \\ ; | & * ? ~ # !",
            "plain/path-1.0_x@y%z+w=v:u,t",
            "\t",
        ];
        assert_eq!(through_sh(&words), words);
        assert_eq!(shell_quote("plain/path-1.0"), "plain/path-1.0");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
    }

    #[test]
    fn the_run_directory_stays_a_variable() {
        assert_eq!(
            through_sh(&["$RUN_DIR/server.sock", "$RUN_DIR", "$RUN_DIR/a b"]),
            ["/run/x/server.sock", "/run/x", "/run/x/a b"]
        );
    }
}
