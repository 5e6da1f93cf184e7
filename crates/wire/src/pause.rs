//! SGLang's `pause_generation` modes: the engine implements them, the controller, the gateway's
//! fleet control and the gRPC API ask for them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What happens to requests in flight when generation pauses (SGLang's `mode` of
/// `POST /pause_generation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Abort everything in flight: requests finish with `finish_reason.type == "abort"` and
    /// clients (Troupe's data proxy among them) may resubmit.
    #[default]
    Abort,
    /// Drop running requests' KV and requeue them; they recompute and go on after resume.
    Retract,
    /// Freeze running requests where they are, KV kept; they go on after resume.
    InPlace,
}

impl PauseMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [PauseMode; 3] = [PauseMode::Abort, PauseMode::Retract, PauseMode::InPlace];

    /// Parses SGLang's spelling (`abort`, `retract`, `in_place`).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// SGLang's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Retract => "retract",
            Self::InPlace => "in_place",
        }
    }

    /// The accepted spellings, for error messages.
    pub fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

impl fmt::Display for PauseMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_through_parse_and_serde() {
        for m in PauseMode::ALL {
            assert_eq!(PauseMode::parse(m.as_str()), Some(m));
            let j = serde_json::to_string(&m).unwrap();
            assert_eq!(j, format!("\"{}\"", m.as_str()));
        }
        assert_eq!(PauseMode::parse("inplace"), None);
    }
}
