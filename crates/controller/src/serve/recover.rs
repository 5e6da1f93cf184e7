//! After `--recover`: the engines are brought to the state the fleet was in, not left as the
//! dead controller left them.
//!
//! A controller killed in the middle of a weight update (or of any fleet operation) leaves the
//! engines it had paused paused: every `/generate` would wait forever while a fresh control
//! plane reported `is_paused: false`. The state file records the plane's [`Status`] (whether
//! a client paused the fleet); the recovering controller applies it:
//!
//! - a client had paused the fleet: every engine is paused again in that mode (one the dead
//!   controller had not reached yet included), and the fleet reports paused;
//! - otherwise the fleet resumes, on one weight version only (the plane's resume rule): the
//!   engines the dead controller paused serve again;
//! - engines on different weight versions (an update that reached some): the fleet is held,
//!   every engine paused and the fleet reporting paused, and the report says how to go on;
//! - engines that do not answer are reported; the others serve.

use troupe_serving::control_plane::Status;
use troupe_wire::PauseMode;

use super::deployment::Deployment;

/// What recovery did with the fleet, for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Every engine serves (on one weight version).
    Serving(String),
    /// Every engine is paused, as a client had left the fleet.
    Paused(String),
    /// The fleet is held paused: it cannot serve as it is; the message says why and what to do.
    Held(String),
}

impl Settled {
    /// The line to print.
    pub fn message(&self) -> &str {
        match self {
            Settled::Serving(m) | Settled::Paused(m) | Settled::Held(m) => m,
        }
    }
}

impl Deployment {
    /// Brings every engine to `recorded` (the state file's fleet status).
    pub async fn settle_recovered(&self, recorded: Status) -> Settled {
        if let Some(mode) = recorded.paused {
            return match self.plane.pause(mode, false).await {
                Ok(_) => Settled::Paused(format!(
                    "the fleet was paused ({}) by a client when the last controller stopped: every engine is paused; POST /continue_generation resumes it",
                    mode.as_str()
                )),
                Err(e) => self.hold(format!(
                    "the fleet was paused by a client, and pausing every engine again failed ({})",
                    e.message
                )).await,
            };
        }
        match self.plane.resume().await {
            Ok(_) => Settled::Serving(
                "every engine serves on one weight version (any the last controller had paused were resumed)"
                    .into(),
            ),
            Err(e) if e.status.as_u16() == 409 => self.hold(e.message).await,
            Err(e) => Settled::Serving(format!(
                "the engines that answered serve again on one weight version; {}",
                e.message
            )),
        }
    }

    /// Pauses every engine it can reach and reports the fleet held, saying `why`.
    async fn hold(&self, why: String) -> Settled {
        let paused = match self.plane.pause(PauseMode::InPlace, false).await {
            Ok(_) => "every engine is paused".to_string(),
            Err(e) => format!(
                "pausing every engine failed too ({}): the ones that answered are paused",
                e.message
            ),
        };
        Settled::Held(format!(
            "the fleet is held: {why}; {paused}. Push weights to every engine (the trainer's next update, or POST /update_weights_from_tensor), then POST /continue_generation"
        ))
    }
}
