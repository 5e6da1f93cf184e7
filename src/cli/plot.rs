//! A run's curves as one SVG a person opens in a browser: reward, generation tokens/s, weight
//! sync seconds and staleness per step, one panel each (drawn with `plotters`). `troupe run
//! --plot run.svg` and `examples/grpo.rs` both call [`write_svg`].

use std::path::Path;

use plotters::prelude::*;

use troupe_controller::run::Summary;

/// One panel: a title and a value per step.
struct Series<'a> {
    title: &'a str,
    values: Vec<f64>,
    color: RGBColor,
}

/// Writes `summary`'s per-step curves to `path` as SVG.
pub fn write_svg(summary: &Summary, path: &Path) -> Result<(), String> {
    let panels = [
        Series {
            title: "mean reward",
            values: summary.rewards.iter().map(|r| f64::from(*r)).collect(),
            color: RGBColor(31, 119, 180),
        },
        Series {
            title: "generation tokens/s",
            values: summary.tokens_per_s.clone(),
            color: RGBColor(44, 160, 44),
        },
        Series {
            title: "weight sync seconds",
            values: summary.sync_seconds.clone(),
            color: RGBColor(214, 39, 40),
        },
        Series {
            title: "staleness (versions)",
            values: summary.staleness.iter().map(|s| *s as f64).collect(),
            color: RGBColor(148, 103, 189),
        },
    ];
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(
            &format!(
                "troupe run: {} steps, {} weights, reward {:.3} -> {:.3}",
                summary.steps, summary.weight_format, summary.baseline_reward, summary.final_reward
            ),
            ("sans-serif", 22),
        )
        .map_err(|e| err(&e))?;
    for (area, s) in root.split_evenly((2, 2)).iter().zip(&panels) {
        panel(area, s).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    s: &Series<'_>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let n = s.values.len().max(1);
    let finite = s.values.iter().copied().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((0.0f64, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let hi = if hi <= lo { lo + 1.0 } else { hi * 1.05 };
    let mut chart = ChartBuilder::on(area)
        .caption(s.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(1usize..n, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .light_line_style(WHITE)
        .draw()?;
    chart.draw_series(LineSeries::new(
        s.values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, v)| (i + 1, *v)),
        s.color.stroke_width(2),
    ))?;
    Ok(())
}
