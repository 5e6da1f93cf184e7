//! A receiver that reads its chain link no faster than a given rate, as if the link were that
//! slow: on one machine a loopback link is a memory copy, so this is how a benchmark measures
//! what a sync costs between machines (every hop reads at most this fast, so the whole chain
//! runs at it, and the sender is held back by the kernel's flow control).

use std::time::Duration;

use tokio::time::Instant;

use super::TcpError;

/// Fastest link a pace may model, in Gb/s (beyond it a pace would not slow anything).
const MAX_GBPS: f64 = 10_000.0;

/// A link quiet for longer than this starts afresh; within it, the link's timeline goes on, so
/// a wait the timer overshot (it ticks in milliseconds, and a read takes microseconds at
/// 10 Gb/s) is made up by the reads after it instead of lost.
pub(crate) const IDLE: Duration = Duration::from_millis(2);

/// When the bytes read so far would have finished arriving over a link of a given rate.
#[derive(Debug, Clone)]
pub(crate) struct Pace {
    bytes_per_sec: f64,
    /// When the link would be done delivering what was read; time idle past [`IDLE`] earns
    /// no credit.
    free_at: Option<Instant>,
}

impl Pace {
    /// A link of `gbps` gigabits per second; refuses a rate that is not a positive number.
    pub(crate) fn gbps(gbps: f64) -> Result<Self, TcpError> {
        if !(gbps.is_finite() && gbps > 0.0 && gbps <= MAX_GBPS) {
            return Err(TcpError::InvalidArgument(format!(
                "a link rate is a number of Gb/s in (0, {MAX_GBPS}], e.g. 10; got {gbps}"
            )));
        }
        Ok(Self {
            bytes_per_sec: gbps * 1e9 / 8.0,
            free_at: None,
        })
    }

    /// Accounts for `n` bytes just read and returns when the link would have delivered them,
    /// if that is still ahead.
    pub(crate) fn took(&mut self, n: usize, now: Instant) -> Option<Instant> {
        let from = self.free_at.filter(|t| *t + IDLE > now).unwrap_or(now);
        let done = from + Duration::from_secs_f64(n as f64 / self.bytes_per_sec);
        self.free_at = Some(done);
        (done > now).then_some(done)
    }

    /// Waits until the link would have delivered the `n` bytes just read.
    pub(crate) async fn wait(&mut self, n: usize) {
        if let Some(t) = self.took(n, Instant::now()) {
            tokio::time::sleep_until(t).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_take_their_time_and_idle_time_earns_no_credit() {
        let mut p = Pace::gbps(8.0).unwrap(); // 1e9 bytes/s
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        assert_eq!(p.took(1_000_000, t0), Some(ms(1)));
        // Read again at once: queued behind the first megabyte.
        assert_eq!(p.took(1_000_000, t0), Some(ms(2)));
        // The timer woke 1 ms late: the next megabyte is already due, but not the one after.
        assert_eq!(p.took(1_000_000, ms(3)), None);
        assert_eq!(p.took(1_000_000, ms(3)), Some(ms(4)));
        // After a pause, the link starts from now, not from when it went idle.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(
            p.took(2_000_000, later),
            Some(later + Duration::from_millis(2))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            assert!(Pace::gbps(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn waiting_takes_the_link_time() {
        let r = tokio::time::timeout(Duration::from_secs(20), async {
            let mut p = Pace::gbps(0.8).unwrap(); // 1e8 bytes/s
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                p.wait(1_000_000).await;
            }
            t0.elapsed()
        })
        .await
        .expect("pace test timed out");
        assert!(r >= Duration::from_millis(50), "{r:?}");
    }
}
