//! `troupe run CONFIG [key.path=value ...]`: the main job (the controller library's
//! `run::run`), with what a terminal shows: a progress bar while servers come up, a line per
//! step, the summary as JSON (`--summary`) and the curves as SVG (`--plot`).

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use troupe_controller::run::{RunOptions, StepReport, Summary};
use troupe_controller::serve::fork::{ForkProgress, Progress};

/// Flags of `troupe run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// YAML config (see examples/configs/grpo-local.yaml).
    pub config: PathBuf,
    /// Overrides as dotted.key=value, e.g. train.steps=10.
    pub overrides: Vec<String>,
    /// Write a JSON summary of the run here.
    #[arg(long)]
    pub summary: Option<PathBuf>,
    /// Draw the run's curves (reward, tokens/s, sync seconds, staleness per step) to this SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// A progress bar on stderr for a bring-up: servers ready of all launched.
pub fn bring_up_bar() -> Progress {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} servers ready {pos}/{len} [{elapsed}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    Progress::to(move |p: ForkProgress| {
        bar.set_length(p.total as u64);
        bar.set_position(p.ready as u64);
        if p.ready == p.total {
            bar.finish_and_clear();
        }
    })
}

/// The line printed for a step.
fn line(s: &StepReport) -> String {
    format!(
        "step {:>3}  reward {:.3}  tokens/s {:>6.0}  train {:.2}s  sync {:.3}s {:.2} MB ({})  staleness {}  ratio {:.3}",
        s.step,
        s.reward,
        s.tokens_per_s,
        s.train_seconds,
        s.sync_seconds,
        s.sync_bytes_sent as f64 / 1e6,
        s.weight_format,
        s.staleness,
        s.mean_ratio
    )
}

/// Runs the job; writes the summary and the plot where asked.
pub async fn run(a: &RunArgs) -> Result<Summary, String> {
    // Output paths are checked before anything starts, not after the whole run.
    for (flag, p) in [("--summary", &a.summary), ("--plot", &a.plot)] {
        if let Some(p) = p {
            let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
            if dir.is_some_and(|d| !d.is_dir()) {
                return Err(format!(
                    "{flag} {}: the directory does not exist; create it or pick another path",
                    p.display()
                ));
            }
        }
    }
    let steps = ProgressBar::new(0);
    steps.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{elapsed}<{eta}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let bar = steps.clone();
    let on_step = move |s: &StepReport| {
        bar.set_length(s.of as u64);
        bar.suspend(|| println!("{}", line(s)));
        bar.set_message(format!("reward {:.3}", s.reward));
        bar.set_position(s.step as u64);
    };
    let opts = RunOptions {
        config: a.config.clone(),
        overrides: a.overrides.clone(),
        progress: bring_up_bar(),
    };
    let r = troupe_controller::run::run(&opts, &on_step).await;
    steps.finish_and_clear();
    let summary = r?;
    if let Some(p) = &a.summary {
        let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?;
        std::fs::write(p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        super::plot::write_svg(&summary, p)?;
    }
    Ok(summary)
}
