//! Latency model: on a CPU the tiny model is far faster than a GPU server, so load tests and
//! PD-vs-colocated comparisons would measure nothing. When enabled, each prefill batch takes at
//! least `tokens / prefill_tokens_per_s`, and each decode step at least
//! `decode_step_ms + decode_per_seq_ms × batch_size` (real compute time counts toward it).

use std::time::Duration;

/// Pacing targets; all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyModel {
    /// Simulated prefill throughput in tokens per second.
    pub prefill_tokens_per_s: Option<f64>,
    /// Simulated fixed cost of one decode step, milliseconds.
    pub decode_step_ms: Option<f64>,
    /// Simulated extra cost per sequence in a decode step, milliseconds.
    pub decode_per_seq_ms: f64,
    /// Simulated time to load new weights into the model, seconds: what a committed staged
    /// update or a disk load costs on top of the copy (a GPU server loading gigabytes).
    pub weight_load_s: f64,
    /// Simulated time one bucket of a weight update takes to load, milliseconds.
    pub bucket_load_ms: f64,
}

impl LatencyModel {
    /// Wall time a weight load takes (see [`LatencyModel::weight_load_s`]).
    pub fn weight_load_time(&self) -> Duration {
        Duration::try_from_secs_f64(self.weight_load_s).unwrap_or(Duration::ZERO)
    }

    /// Wall time one bucket of a weight update takes (see [`LatencyModel::bucket_load_ms`]).
    pub fn bucket_load_time(&self) -> Duration {
        Duration::try_from_secs_f64(self.bucket_load_ms / 1e3).unwrap_or(Duration::ZERO)
    }

    /// Minimum wall time for a prefill batch of `tokens` tokens.
    pub fn prefill_time(&self, tokens: usize) -> Duration {
        match self.prefill_tokens_per_s {
            Some(tps) if tps > 0.0 => {
                Duration::try_from_secs_f64(tokens as f64 / tps).unwrap_or(Duration::MAX)
            }
            _ => Duration::ZERO,
        }
    }

    /// Minimum wall time for one decode step over `batch` sequences.
    pub fn decode_time(&self, batch: usize) -> Duration {
        let base = self.decode_step_ms.unwrap_or(0.0);
        let ms = base + self.decode_per_seq_ms * batch as f64;
        if ms > 0.0 {
            Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::MAX)
        } else {
            Duration::ZERO
        }
    }

    /// Sleeps for whatever is left of `target` after `elapsed` of real work.
    pub fn pace(target: Duration, elapsed: Duration) {
        if let Some(rest) = target.checked_sub(elapsed)
            && !rest.is_zero()
        {
            std::thread::sleep(rest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_linear_when_on() {
        let off = LatencyModel::default();
        assert_eq!(off.prefill_time(1000), Duration::ZERO);
        assert_eq!(off.decode_time(8), Duration::ZERO);
        let on = LatencyModel {
            prefill_tokens_per_s: Some(1000.0),
            decode_step_ms: Some(10.0),
            decode_per_seq_ms: 1.0,
            weight_load_s: 0.0,
            bucket_load_ms: 0.0,
        };
        assert_eq!(on.prefill_time(500), Duration::from_millis(500));
        assert_eq!(on.decode_time(4), Duration::from_millis(14));
    }
}
