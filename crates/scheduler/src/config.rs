//! The YAML/serde form of an allocation, converging on the same [`AllocationPlan`].
//!
//! Two shapes are accepted, either as a whole document or embedded in a larger config:
//!
//! ```yaml
//! allocation_mode: "sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8"
//! ```
//!
//! ```yaml
//! components:
//!   - backend: sglang
//!     name: rollout
//!     groups:
//!       - {worker_type: prefill, dp: 2, tp: 2, overrides: {disaggregation_transfer_backend: mooncake}}
//!       - {worker_type: decode, dp: 4}
//!   - {backend: fsdp, name: actor, dp: 8}
//! ```
//!
//! `AllocationPlan` itself deserializes from either shape or from a bare mode string, and always
//! runs the same validation as [`AllocationPlan::parse`].

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::backend::{Backend, Role, WorkerType};
use crate::error::SchedulerError;
use crate::parallel::Parallel;
use crate::plan::{AllocationPlan, Component, Group};

/// A corrected config shown in config errors.
const CONFIG_EXAMPLE: &str = "  allocation_mode: \"sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8\"\n  \
# or explicit components:\n  components:\n    - backend: sglang\n      name: rollout\n      \
groups:\n        - {worker_type: prefill, dp: 2, tp: 2}\n        - {worker_type: decode, dp: 4}\n    \
- {backend: fsdp, name: actor, dp: 8}";

/// The serde shape of an allocation: a mode string, or explicit components.
///
/// It exists so YAML configs can say everything a mode string says, plus per-group server
/// `overrides`, and still land on the one validated [`AllocationPlan`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocationConfig {
    /// An allocation-mode string; exclusive with `components`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<String>,
    /// Explicit components; exclusive with `allocation_mode`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<ComponentConfig>,
}

/// One component in the explicit config form.
///
/// Either `groups` (several, e.g. prefill and decode) or inline dims (`dp`, `tp`, …: one group of
/// type `regular` for inference, `train` for training).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentConfig {
    /// Engine or trainer.
    pub backend: Backend,
    /// Optional unique name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Name of the component whose GPUs this one reuses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub colocate_with: Option<String>,
    /// Instance groups; leave empty to use the inline dims below.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupConfig>,
    /// Inline data parallel size (single-group shorthand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<u32>,
    /// Inline tensor parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// Inline pipeline parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp: Option<u32>,
    /// Inline context parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp: Option<u32>,
    /// Inline expert parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep: Option<u32>,
    /// Inline expert tensor parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<u32>,
}

/// One group in the explicit config form; omitted sizes are 1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// `regular`, `prefill`, `decode` or `train`; defaults by the component's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<WorkerType>,
    /// Data parallel size (number of servers for inference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<u32>,
    /// Tensor parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// Pipeline parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp: Option<u32>,
    /// Context parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp: Option<u32>,
    /// Expert parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep: Option<u32>,
    /// Expert tensor parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<u32>,
    /// Extra server arguments for this group only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, serde_json::Value>,
}

fn config_error(message: impl Into<String>) -> SchedulerError {
    SchedulerError::Config {
        message: message.into(),
        example: CONFIG_EXAMPLE.to_string(),
    }
}

fn parallel_of(dims: [Option<u32>; 6]) -> Parallel {
    let [dp, tp, pp, cp, ep, etp] = dims.map(|d| d.unwrap_or(1));
    Parallel {
        dp,
        tp,
        pp,
        cp,
        ep,
        etp,
    }
}

impl ComponentConfig {
    fn inline_dims(&self) -> [Option<u32>; 6] {
        [self.dp, self.tp, self.pp, self.cp, self.ep, self.etp]
    }

    fn into_component(self, index: usize) -> Result<Component, SchedulerError> {
        let default_type = match self.backend.role() {
            Role::Inference => WorkerType::Regular,
            Role::Training => WorkerType::Train,
        };
        let has_inline = self.inline_dims().iter().any(Option::is_some);
        let groups = if self.groups.is_empty() {
            vec![Group::new(default_type, parallel_of(self.inline_dims()))]
        } else if has_inline {
            return Err(config_error(format!(
                "component {index} (`{}`) has both `groups` and inline sizes (dp, tp, …); put the \
                 sizes inside each group",
                self.backend
            )));
        } else {
            self.groups
                .into_iter()
                .map(|g| Group {
                    worker_type: g.worker_type.unwrap_or(default_type),
                    parallel: parallel_of([g.dp, g.tp, g.pp, g.cp, g.ep, g.etp]),
                    overrides: g.overrides,
                })
                .collect()
        };
        Ok(Component {
            backend: self.backend,
            name: self.name,
            colocate_with: self.colocate_with,
            groups,
        })
    }
}

impl AllocationConfig {
    /// Converts and validates; the result is the same plan a mode string would give.
    pub fn into_plan(self) -> Result<AllocationPlan, SchedulerError> {
        match (self.allocation_mode, self.components.is_empty()) {
            (Some(_), false) => Err(config_error(
                "give either `allocation_mode` or `components`, not both",
            )),
            (None, true) => Err(config_error(
                "the allocation is empty; give `allocation_mode` or `components`",
            )),
            (Some(mode), true) => AllocationPlan::parse(&mode),
            (None, false) => {
                let components = self
                    .components
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| c.into_component(i))
                    .collect::<Result<Vec<_>, _>>()?;
                let plan = AllocationPlan { components };
                plan.validate().map_err(|e| match e {
                    SchedulerError::Rule {
                        mode,
                        message,
                        example,
                    } => SchedulerError::Config {
                        message: format!("{message} (the components read as `{mode}`)"),
                        example: format!("  allocation_mode: \"{example}\""),
                    },
                    other => other,
                })?;
                Ok(plan)
            }
        }
    }
}

impl AllocationPlan {
    /// Reads a YAML document in either config shape (see the module docs).
    pub fn from_yaml(text: &str) -> Result<AllocationPlan, SchedulerError> {
        crate::yaml::check(text).map_err(config_error)?;
        let config: AllocationConfig =
            serde_yaml_ng::from_str(text).map_err(|e| config_error(e.to_string()))?;
        config.into_plan()
    }

    /// The explicit config form of this plan (keeps per-group overrides).
    pub fn to_config(&self) -> AllocationConfig {
        let components = self
            .components
            .iter()
            .map(|c| ComponentConfig {
                backend: c.backend,
                name: c.name.clone(),
                colocate_with: c.colocate_with.clone(),
                groups: c
                    .groups
                    .iter()
                    .map(|g| GroupConfig {
                        worker_type: Some(g.worker_type),
                        dp: Some(g.parallel.dp),
                        tp: Some(g.parallel.tp),
                        pp: Some(g.parallel.pp),
                        cp: Some(g.parallel.cp),
                        ep: Some(g.parallel.ep),
                        etp: Some(g.parallel.etp),
                        overrides: g.overrides.clone(),
                    })
                    .collect(),
                dp: None,
                tp: None,
                pp: None,
                cp: None,
                ep: None,
                etp: None,
            })
            .collect();
        AllocationConfig {
            allocation_mode: None,
            components,
        }
    }
}

/// Serializes as the explicit components form, so overrides survive a round trip.
impl Serialize for AllocationPlan {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_config().serialize(serializer)
    }
}

/// Accepts a bare mode string, `{allocation_mode: …}` or `{components: […]}`; validates.
impl<'de> Deserialize<'de> for AllocationPlan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PlanVisitor;

        impl<'de> Visitor<'de> for PlanVisitor {
            type Value = AllocationPlan;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an allocation mode string such as \"sglang:d4+fsdp:d4\", or a map with \
                     `allocation_mode` or `components`",
                )
            }

            fn visit_str<E: de::Error>(self, mode: &str) -> Result<AllocationPlan, E> {
                AllocationPlan::parse(mode).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<AllocationPlan, A::Error> {
                let config =
                    AllocationConfig::deserialize(de::value::MapAccessDeserializer::new(map))?;
                config.into_plan().map_err(de::Error::custom)
            }
        }

        deserializer.deserialize_any(PlanVisitor)
    }
}
