//! `troupe quantize`: convert a BF16/F32 safetensors checkpoint for FP8 serving.

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use troupe_weights::fp8::{BlockSize, Fp8Options, Granularity, ScaleDtype};
use troupe_weights::quantize_file::quantize_file_with_progress;

/// Flags of `troupe quantize`.
#[derive(Debug, Clone, clap::Args)]
pub struct QuantizeArgs {
    /// Input checkpoint (.safetensors, BF16 or F32 weights).
    pub input: PathBuf,
    /// Output checkpoint; written atomically (nothing is left behind on error).
    pub output: PathBuf,
    /// Block size (square); 0 selects one scale per tensor (`<name>.weight_scale`).
    #[arg(long, default_value_t = 128)]
    pub block: usize,
    /// Store scales as bf16 instead of f32.
    #[arg(long)]
    pub bf16_scales: bool,
}

/// Quantizes with a progress bar on stderr and returns the summary to print.
pub fn run(a: &QuantizeArgs) -> Result<String, String> {
    let granularity = if a.block == 0 {
        Granularity::PerTensor
    } else {
        Granularity::Block(BlockSize::new(a.block, a.block).map_err(|e| e.to_string())?)
    };
    let opts = Fp8Options {
        granularity,
        scale_dtype: if a.bf16_scales {
            ScaleDtype::Bf16
        } else {
            ScaleDtype::F32
        },
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} quantizing [{bar:40}] {bytes}/{total_bytes} ({eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let r = quantize_file_with_progress(&a.input, &a.output, &opts, &mut |p| {
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
    });
    bar.finish_and_clear();
    r.map(|s| s.to_string()).map_err(|e| e.to_string())
}
