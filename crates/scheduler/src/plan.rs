//! The allocation plan: the one structure every config path converges on.
//!
//! `AllocationPlan` → `Component` (one GPU pool, or colocated on another) → `Group` (a set of
//! identical instances of one worker type). A plain `sglang:d4t2` is one component with one
//! `regular` group; `sglang:(prefill:d2t2|decode:d4t1)` is one component with a prefill and a
//! decode group; a training component has one `train` group.

use std::collections::BTreeMap;
use std::fmt;

use crate::backend::{Backend, Role, WorkerType};
use crate::parallel::Parallel;

/// Largest number of GPUs a plan may ask for; keeps absurd inputs from allocating huge tables.
pub const MAX_GPUS: u64 = 1 << 20;

/// Most components one allocation may have: real jobs have a handful (rollout, actor, critic,
/// ref, …); the cap keeps error reporting and placement bounded whatever the input.
pub const MAX_COMPONENTS: usize = 64;

/// Most hosts (nodes) one cluster may have: `troupe alloc --hosts` and `cluster.n_nodes` share
/// it, so sizes are refused before anything is allocated for them.
pub const MAX_HOSTS: usize = 4096;

/// A validated allocation: which backends run where, with which parallelism.
///
/// It exists so that the controller, the launcher and `troupe alloc` all read the same thing,
/// whether the allocation came from a mode string (`AllocationPlan::parse`) or from a YAML config
/// (`AllocationPlan::from_yaml`, or `Deserialize`). Build it through those entry points; a plan
/// assembled by hand can be checked with [`AllocationPlan::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct AllocationPlan {
    /// Components in the order they were written.
    pub components: Vec<Component>,
}

/// One backend's share of the cluster: a GPU pool of its own, or colocated on another component.
#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    /// Engine or trainer.
    pub backend: Backend,
    /// Optional name (`sglang[rollout]:…`); required with 3+ components and for colocation.
    pub name: Option<String>,
    /// Name of the component whose GPUs this one reuses (`a|b`: b colocates with a).
    pub colocate_with: Option<String>,
    /// Instance groups; one for plain components, several for PD.
    pub groups: Vec<Group>,
}

/// A set of identical instances: `{worker_type, parallel, overrides}`.
///
/// It exists so that prefill and decode (or any future heterogeneous groups of one model) get
/// their own GPU bundles, ports and server arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// What the instances are (regular, prefill, decode, train).
    pub worker_type: WorkerType,
    /// Parallel sizes of the group.
    pub parallel: Parallel,
    /// Extra server arguments for this group only (from YAML configs; empty from mode strings).
    pub overrides: BTreeMap<String, serde_json::Value>,
}

impl Group {
    /// A group with the given type and parallelism and no overrides.
    pub fn new(worker_type: WorkerType, parallel: Parallel) -> Self {
        Group {
            worker_type,
            parallel,
            overrides: BTreeMap::new(),
        }
    }

    /// Number of launched instances: `d` servers for inference, `d·t·p·c` ranks for training.
    pub fn instances(&self) -> u64 {
        match self.worker_type {
            WorkerType::Train => self.parallel.world_size(),
            _ => u64::from(self.parallel.dp),
        }
    }

    /// GPUs each instance uses: `t·p` for a server, 1 for a training rank.
    pub fn gpus_per_instance(&self) -> u64 {
        match self.worker_type {
            WorkerType::Train => 1,
            _ => self.parallel.model_parallel_size(),
        }
    }

    /// GPUs of the whole group.
    pub fn world_size(&self) -> u64 {
        self.parallel.world_size()
    }
}

impl Component {
    /// Inference or training, from the backend.
    pub fn role(&self) -> Role {
        self.backend.role()
    }

    /// GPUs this component's instances use (also when colocated, where they are borrowed).
    pub fn world_size(&self) -> u64 {
        self.groups
            .iter()
            .fold(0u64, |acc, g| acc.saturating_add(g.world_size()))
    }

    /// Whether the component is split into prefill and decode groups.
    pub fn is_pd(&self) -> bool {
        self.groups
            .iter()
            .any(|g| matches!(g.worker_type, WorkerType::Prefill | WorkerType::Decode))
    }

    /// The name, or `backend` when unnamed; used in messages and tables.
    pub fn label(&self) -> String {
        match &self.name {
            Some(name) => format!("{}[{name}]", self.backend),
            None => self.backend.to_string(),
        }
    }
}

impl AllocationPlan {
    /// GPUs the plan needs: the sum over components that are not colocated.
    pub fn world_size(&self) -> u64 {
        self.components
            .iter()
            .filter(|c| c.colocate_with.is_none())
            .fold(0u64, |acc, c| acc.saturating_add(c.world_size()))
    }

    /// The component with this name, if any.
    pub fn component(&self, name: &str) -> Option<&Component> {
        self.components
            .iter()
            .find(|c| c.name.as_deref() == Some(name))
    }

    /// Index of the component with this name, if any.
    /// (`#i` refers to component `i` by position: how members colocate with an unnamed anchor,
    /// which AReaL allows; names cannot start with `#`.)
    pub fn component_index(&self, name: &str) -> Option<usize> {
        if let Some(i) = name.strip_prefix('#').and_then(|i| i.parse::<usize>().ok()) {
            return (i < self.components.len()).then_some(i);
        }
        self.components
            .iter()
            .position(|c| c.name.as_deref() == Some(name))
    }

    /// Inference components, in order.
    pub fn inference(&self) -> impl Iterator<Item = &Component> {
        self.components
            .iter()
            .filter(|c| c.role() == Role::Inference)
    }

    /// Training components, in order.
    pub fn training(&self) -> impl Iterator<Item = &Component> {
        self.components
            .iter()
            .filter(|c| c.role() == Role::Training)
    }
}

/// Renders the canonical mode string; parsing it gives back an equal plan (overrides aside).
impl fmt::Display for AllocationPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Pools: each non-colocated component, followed by the members colocated on it. A member
        // whose target is missing or itself colocated is shown as a pool of its own, so that even
        // an invalid plan renders every component exactly once.
        let anchor_of = |c: &Component| -> Option<usize> {
            let target = self.component_index(c.colocate_with.as_deref()?)?;
            let target_is_member = self.components.get(target)?.colocate_with.is_some();
            (!target_is_member).then_some(target)
        };
        let mut first_pool = true;
        for (i, anchor) in self.components.iter().enumerate() {
            if anchor_of(anchor).is_some() {
                continue;
            }
            if !first_pool {
                f.write_str("+")?;
            }
            first_pool = false;
            write!(f, "{anchor}")?;
            for member in &self.components {
                if anchor_of(member) == Some(i) {
                    write!(f, "|{member}")?;
                }
            }
        }
        Ok(())
    }
}

/// Renders `backend[name]:dims`, the hybrid `(attn:…|ffn:…)` form or PD sections.
impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.label())?;
        f.write_str(":")?;
        match self.groups.as_slice() {
            [only] if only.worker_type == WorkerType::Train => {
                let p = only.parallel;
                if p.etp != 1 {
                    let attn = Parallel { ep: 1, ..p }.dims_string("dtpc");
                    let mut ffn = String::new();
                    for (letter, value) in [('t', p.etp), ('p', p.pp), ('e', p.ep)] {
                        if value != 1 {
                            ffn.push(letter);
                            ffn.push_str(&value.to_string());
                        }
                    }
                    write!(f, "(attn:{attn}|ffn:{ffn})")
                } else {
                    f.write_str(&p.dims_string("dtpce"))
                }
            }
            [only] if only.worker_type == WorkerType::Regular => {
                f.write_str(&only.parallel.dims_string("dtp"))
            }
            groups => {
                f.write_str("(")?;
                for (i, g) in groups.iter().enumerate() {
                    if i > 0 {
                        f.write_str("|")?;
                    }
                    write!(f, "{}:{}", g.worker_type, g.parallel.dims_string("dtpce"))?;
                }
                f.write_str(")")
            }
        }
    }
}
