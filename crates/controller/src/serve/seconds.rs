//! The one rule for the config's duration keys (`*_s`): `config.rs` and `sched.rs` both check
//! theirs with it. It sits below both so that `scheduler.*` (`sched.rs`) does not depend on the
//! config that embeds it.

/// Longest duration any `*_s` key accepts: a week. Past it a number is a typo (`1e20`), and
/// far past it `Duration::from_secs_f64` cannot represent it at all.
pub const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Checks a duration key: a finite number of seconds in `min..=MAX_SECONDS`.
pub(crate) fn check_seconds(key: &str, v: f64, min: f64) -> Result<(), String> {
    if v.is_finite() && (min..=MAX_SECONDS).contains(&v) {
        Ok(())
    } else {
        Err(format!(
            "{key} must be a number of seconds from {min} to {MAX_SECONDS} (a week), got {v}"
        ))
    }
}
