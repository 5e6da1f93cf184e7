//! The one error type of the scheduler crate.
//!
//! Every variant carries enough context to act on it: which token or rule is at fault and, where
//! one can be computed, a corrected example. Nothing in this crate panics on user input; it
//! returns one of these instead.

/// Everything that can go wrong while turning an allocation mode into placed servers.
///
/// It exists so that the controller, the `troupe alloc` CLI and config loading all report the
/// same, actionable messages (`need 16 GPUs, have 8`, `use sglang:d4+fsdp:d4`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// The allocation-mode string does not follow the grammar.
    #[error(
        "invalid allocation mode `{}` at column {column}: {message}\n  example: {}",
        clip(input),
        clip(example)
    )]
    Syntax {
        /// The whole string as given.
        input: String,
        /// 1-based character column of the offending token.
        column: usize,
        /// What was found and what was expected.
        message: String,
        /// A corrected allocation mode.
        example: String,
    },

    /// The mode is well formed but breaks one of the allocation rules.
    #[error(
        "invalid allocation mode `{}`: {message}\n  example: {}",
        clip(mode),
        clip(example)
    )]
    Rule {
        /// The offending mode (as given, or rendered from a config).
        mode: String,
        /// Which rule is broken and by which component.
        message: String,
        /// A corrected allocation mode.
        example: String,
    },

    /// A YAML/serde allocation config could not be read.
    #[error("invalid allocation config: {message}\n  example:\n{example}")]
    Config {
        /// What is wrong with the config.
        message: String,
        /// A corrected config snippet.
        example: String,
    },

    /// The hosts together do not have as many GPUs as the plan needs.
    #[error(
        "not enough GPUs: need {needed} GPUs, have {available} on {hosts} host(s); add hosts or \
         shrink the allocation mode"
    )]
    NotEnoughGpus {
        /// GPUs the plan needs (colocated components add none).
        needed: u64,
        /// GPUs the hosts advertise in total.
        available: u64,
        /// Number of hosts offered.
        hosts: usize,
    },

    /// Enough GPUs exist in total, but not in the shape one instance needs.
    #[error("cannot place {what}: need {needed} GPUs {shape}, have {free}")]
    NoRoom {
        /// The instance that could not be placed (component, group, instance).
        what: String,
        /// GPUs that instance needs.
        needed: u64,
        /// The constraint that failed (on one host, on whole free hosts, ...).
        shape: String,
        /// What is actually free.
        free: String,
    },

    /// The host list given to placement is malformed.
    #[error("invalid hosts: {message}\n  example: {example}")]
    Hosts {
        /// What is wrong with the host list.
        message: String,
        /// A corrected host description.
        example: String,
    },

    /// The port range is malformed.
    #[error("invalid port range {start}-{end}: {message}; example: 10000-32767")]
    PortRange {
        /// First port of the range.
        start: u16,
        /// Last port of the range (inclusive).
        end: u16,
        /// What is wrong with it.
        message: String,
    },

    /// Every port of a host's range has been handed out or is in use.
    #[error(
        "port range {start}-{end} on host {host} is exhausted (ports are taken or already handed \
         out); widen the range, e.g. 10000-32767"
    )]
    PortsExhausted {
        /// Host index.
        host: usize,
        /// First port of the range.
        start: u16,
        /// Last port of the range (inclusive).
        end: u16,
    },

    /// A request named an instance or host that does not exist.
    #[error("unknown {what}: {detail}")]
    Unknown {
        /// What kind of thing was looked up.
        what: String,
        /// Which one, and what exists.
        detail: String,
    },

    /// Arguments of `troupe alloc` are invalid.
    #[error("invalid `troupe alloc` arguments: {message}\n  example: {example}")]
    Args {
        /// What is wrong.
        message: String,
        /// A corrected command line.
        example: String,
    },
}

/// Echoes at most a screenful of user input in a message (the start, then how much was left
/// out), so an error about a huge input is still short.
fn clip(s: &str) -> String {
    const SHOWN: usize = 200;
    let n = s.chars().count();
    if n <= SHOWN {
        s.to_string()
    } else {
        let head: String = s.chars().take(SHOWN).collect();
        format!("{head}… ({} more characters)", n - SHOWN)
    }
}
