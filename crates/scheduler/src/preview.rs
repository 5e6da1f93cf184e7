//! `troupe alloc MODE [--hosts N] [--gpus-per-host G] [--json]`: show what a mode means.
//!
//! The binary owns argument parsing and printing; this module owns the arguments and the exact
//! output, so the text is testable (golden files) without spawning a process. [`AllocArgs`] is
//! plain data; with the `cli` feature (turned on only by the `troupe` binary's package) it also
//! derives `clap::Args`, so its fields are the flags' one definition.

use crate::error::SchedulerError;
use crate::hosts::HostResources;
use crate::placement::{PlacementOptions, place};
use crate::plan::{AllocationPlan, MAX_GPUS, MAX_HOSTS};
use crate::ports::PortAllocator;
use crate::report;

/// Arguments of `troupe alloc`.
///
/// It exists so operators can check an allocation mode (and where it would land) before a run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct AllocArgs {
    /// Allocation mode, e.g. `sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8`.
    pub mode: String,
    /// Also place the plan on this many identical hosts and print the placement.
    #[cfg_attr(feature = "cli", arg(long))]
    pub hosts: Option<usize>,
    /// GPUs per host for `--hosts`.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 8))]
    pub gpus_per_host: u32,
    /// Print exactly one JSON object instead of the table.
    #[cfg_attr(feature = "cli", arg(long))]
    pub json: bool,
}

/// Runs `troupe alloc`: the exact stdout text (no trailing newline; print it with `println!`).
///
/// On `Err` the binary prints the error to stderr and exits with status 2. Ports in the
/// placement come from the default range 10000–32767 without probing: this is a preview for
/// hypothetical hosts `host0…`; a real launch probes and relays ports again.
pub fn run_alloc(args: &AllocArgs) -> Result<String, SchedulerError> {
    let plan = AllocationPlan::parse(&args.mode)?;
    let placement = match args.hosts {
        None => None,
        Some(hosts) => {
            check_hosts(hosts, args.gpus_per_host, &args.mode)?;
            let inventory = HostResources::uniform(hosts, args.gpus_per_host);
            let mut ports = PortAllocator::preview();
            Some(place(
                &plan,
                &inventory,
                &mut ports,
                &PlacementOptions::default(),
            )?)
        }
    };
    if args.json {
        return report::json(&plan, placement.as_ref()).map_err(|e| SchedulerError::Args {
            message: format!("could not render JSON: {e}"),
            example: format!("troupe alloc '{}'", args.mode),
        });
    }
    let title = args
        .hosts
        .map(|h| format!("placement ({h} hosts x {} GPUs)", args.gpus_per_host));
    Ok(report::text(&plan, placement.as_ref().zip(title)))
}

fn check_hosts(hosts: usize, gpus_per_host: u32, mode: &str) -> Result<(), SchedulerError> {
    let example = format!("troupe alloc '{mode}' --hosts 2 --gpus-per-host 8");
    if hosts == 0 {
        return Err(SchedulerError::Args {
            message: "--hosts must be at least 1".into(),
            example,
        });
    }
    if hosts > MAX_HOSTS {
        return Err(SchedulerError::Args {
            message: format!("--hosts {hosts} is more than the supported {MAX_HOSTS}"),
            example,
        });
    }
    if gpus_per_host == 0 {
        return Err(SchedulerError::Args {
            message: "--gpus-per-host must be at least 1".into(),
            example,
        });
    }
    let total = (hosts as u64).saturating_mul(u64::from(gpus_per_host));
    if total > MAX_GPUS {
        return Err(SchedulerError::Args {
            message: format!(
                "--hosts {hosts} x --gpus-per-host {gpus_per_host} = {total} GPUs, more than the \
                 supported {MAX_GPUS}"
            ),
            example,
        });
    }
    Ok(())
}
