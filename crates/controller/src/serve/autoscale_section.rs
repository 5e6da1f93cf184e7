//! `autoscale.*` in a deployment's YAML: the autoscaler's policy (`autoscale.rs`), off unless
//! `enabled: true`.
//!
//! ```yaml
//! autoscale:
//!   enabled: true
//!   min: 1              # fewest servers per role
//!   max: 4              # most servers per role (each must fit on free GPUs)
//!   scale_up_at: 8      # requests in flight per routed server above which one is added
//!   scale_down_at: 1    # ... below which the least loaded is drained and removed
//!   cooldown_s: 60      # quiet time per role after a change
//! ```

use std::time::Duration;

use serde::Deserialize;

use super::autoscale::AutoscaleOptions;
use super::seconds::check_seconds;

/// `autoscale.*`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleSection {
    /// Whether the autoscaler runs (default: no).
    #[serde(default)]
    pub enabled: bool,
    /// Fewest servers of a role (default 1).
    #[serde(default = "one")]
    pub min: usize,
    /// Most servers of a role (default 8).
    #[serde(default = "eight")]
    pub max: usize,
    /// Requests in flight per routed server above which a server is added (default 8).
    #[serde(default = "eight_f")]
    pub scale_up_at: f64,
    /// Requests in flight per routed server below which one is removed (default 1).
    #[serde(default = "one_f")]
    pub scale_down_at: f64,
    /// Seconds a role waits after a change (default 60).
    #[serde(default = "sixty")]
    pub cooldown_s: f64,
    /// Seconds between looks at the load (default 2).
    #[serde(default = "two")]
    pub interval_s: f64,
    /// Longest drain of a removed server, in seconds (default 120).
    #[serde(default = "drain")]
    pub drain_timeout_s: f64,
}

fn one() -> usize {
    1
}
fn eight() -> usize {
    8
}
fn eight_f() -> f64 {
    8.0
}
fn one_f() -> f64 {
    1.0
}
fn sixty() -> f64 {
    60.0
}
fn two() -> f64 {
    2.0
}
fn drain() -> f64 {
    120.0
}

impl Default for AutoscaleSection {
    /// What an absent `autoscale:` means: off, with the defaults above.
    fn default() -> Self {
        AutoscaleSection {
            enabled: false,
            min: one(),
            max: eight(),
            scale_up_at: eight_f(),
            scale_down_at: one_f(),
            cooldown_s: sixty(),
            interval_s: two(),
            drain_timeout_s: drain(),
        }
    }
}

impl AutoscaleSection {
    /// The policy, when enabled; bad values named by their key.
    pub fn options(&self) -> Result<Option<AutoscaleOptions>, String> {
        if !self.enabled {
            return Ok(None);
        }
        check_seconds("autoscale.cooldown_s", self.cooldown_s, 0.0)?;
        check_seconds("autoscale.interval_s", self.interval_s, 0.01)?;
        check_seconds("autoscale.drain_timeout_s", self.drain_timeout_s, 0.0)?;
        let o = AutoscaleOptions {
            min: self.min,
            max: self.max,
            scale_up_at: self.scale_up_at,
            scale_down_at: self.scale_down_at,
            cooldown: Duration::from_secs_f64(self.cooldown_s),
            interval: Duration::from_secs_f64(self.interval_s),
            drain: Duration::from_secs_f64(self.drain_timeout_s),
        };
        o.check()?;
        Ok(Some(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_bad_values_are_named() {
        assert_eq!(AutoscaleSection::default().options(), Ok(None));
        let on: AutoscaleSection =
            serde_yaml_ng::from_str("enabled: true\nmax: 3\ncooldown_s: 5").unwrap();
        let o = on.options().unwrap().unwrap();
        assert_eq!((o.min, o.max, o.cooldown), (1, 3, Duration::from_secs(5)));
        let bad: AutoscaleSection =
            serde_yaml_ng::from_str("enabled: true\ncooldown_s: -1").unwrap();
        assert!(bad.options().unwrap_err().contains("autoscale.cooldown_s"));
        let bad: AutoscaleSection =
            serde_yaml_ng::from_str("enabled: true\nmin: 3\nmax: 2").unwrap();
        assert!(bad.options().unwrap_err().contains("min"));
        assert!(serde_yaml_ng::from_str::<AutoscaleSection>("maxx: 2").is_err());
    }

    #[test]
    fn a_deployment_config_takes_the_section_and_checks_it_at_load() {
        use crate::serve::ServeConfig;
        let base = "allocation_mode: x\nscheduler: {type: local}\n";
        let c = ServeConfig::from_yaml(base, "t.yaml", &[]).unwrap();
        assert_eq!(c.autoscale.options(), Ok(None), "off by default");
        let on = format!("{base}autoscale: {{enabled: true, max: 2, cooldown_s: 10}}\n");
        let c = ServeConfig::from_yaml(&on, "t.yaml", &[]).unwrap();
        assert_eq!(c.autoscale.options().unwrap().unwrap().max, 2);
        let bad = format!("{base}autoscale: {{enabled: true, min: 3, max: 2}}\n");
        let e = ServeConfig::from_yaml(&bad, "t.yaml", &[]).unwrap_err();
        assert!(e.to_string().contains("autoscale.min"), "{e}");
    }
}
