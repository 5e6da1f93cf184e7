//! The allocation rules, checked on the converged [`AllocationPlan`] whatever its source.
//!
//! Each broken rule yields a [`Violation`] naming the component and rule, with a corrected
//! example computed by fixing a copy of the plan and rendering it.

use std::collections::BTreeSet;

use crate::backend::{Backend, Role, WorkerType};
use crate::error::SchedulerError;
use crate::parallel::Parallel;
use crate::plan::{AllocationPlan, Component, MAX_COMPONENTS, MAX_GPUS};

/// A broken rule: what is wrong and a corrected example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub message: String,
    pub example: String,
}

fn violation(message: String, example: String) -> Violation {
    Violation { message, example }
}

/// Renders `plan` after applying `fix` to a copy: the corrected example of a violation.
fn fixed(plan: &AllocationPlan, fix: impl FnOnce(&mut AllocationPlan)) -> String {
    let mut copy = plan.clone();
    fix(&mut copy);
    copy.to_string()
}

/// Whether `name` is an identifier (`[A-Za-z_][A-Za-z0-9_]*`), the only names the DSL can carry.
pub(crate) fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A name for component `index` that no other component uses: `rollout`/`actor` then numbered.
pub(crate) fn fresh_name(plan: &AllocationPlan, index: usize) -> String {
    let base = match plan.components.get(index).map(Component::role) {
        Some(Role::Inference) => "rollout",
        _ => "actor",
    };
    let taken = |n: &str| plan.components.iter().any(|c| c.name.as_deref() == Some(n));
    if !taken(base) {
        return base.to_string();
    }
    (2..)
        .map(|k| format!("{base}{k}"))
        .find(|n| !taken(n))
        .unwrap_or_else(|| base.to_string())
}

/// Names every unnamed component of `plan` (used to build examples): `rollout`/`actor`, then
/// numbered, skipping names in use. Linear in the number of components (one set of taken
/// names, one counter per base), so huge inputs get their error at once.
pub(crate) fn name_all(plan: &mut AllocationPlan) {
    let mut taken: BTreeSet<String> = plan
        .components
        .iter()
        .filter_map(|c| c.name.clone())
        .collect();
    let mut next: [u64; 2] = [1, 1];
    for c in plan.components.iter_mut().filter(|c| c.name.is_none()) {
        let (base, k) = match c.role() {
            Role::Inference => ("rollout", &mut next[0]),
            Role::Training => ("actor", &mut next[1]),
        };
        let name = loop {
            let candidate = if *k == 1 {
                base.to_string()
            } else {
                format!("{base}{k}")
            };
            *k += 1;
            if !taken.contains(&candidate) {
                break candidate;
            }
        };
        taken.insert(name.clone());
        c.name = Some(name);
    }
}

/// Lists at most a few items, then how many more: error messages stay short whatever the input.
fn few(items: &[String]) -> String {
    const SHOWN: usize = 5;
    if items.len() <= SHOWN {
        items.join(", ")
    } else {
        format!(
            "{} and {} more",
            items[..SHOWN].join(", "),
            items.len() - SHOWN
        )
    }
}

/// The rules' entry point lives with the rules, so the plan's types (`plan.rs`) do not depend
/// on them.
impl AllocationPlan {
    /// Checks every allocation rule; returns a [`SchedulerError::Rule`] naming the broken one.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        validate(self).map_err(|v| SchedulerError::Rule {
            mode: self.to_string(),
            message: v.message,
            example: v.example,
        })
    }
}

/// Checks every rule of the allocation language on `plan`.
pub(crate) fn validate(plan: &AllocationPlan) -> Result<(), Violation> {
    if plan.components.is_empty() {
        return Err(violation(
            "the allocation has no components".into(),
            "sglang:d4+fsdp:d4".into(),
        ));
    }
    if plan.components.len() > MAX_COMPONENTS {
        return Err(violation(
            format!(
                "the allocation has {} components; at most {MAX_COMPONENTS} are allowed",
                plan.components.len()
            ),
            "rollout:sglang:d4+actor:fsdp:d4".into(),
        ));
    }
    for (i, component) in plan.components.iter().enumerate() {
        check_component(plan, i, component)?;
    }
    check_names(plan)?;
    check_colocation(plan)?;
    let total = plan.world_size();
    if total > MAX_GPUS {
        return Err(violation(
            format!("the allocation needs {total} GPUs, more than the supported {MAX_GPUS}"),
            "sglang:d64t8+megatron:d64p2t4".into(),
        ));
    }
    Ok(())
}

fn check_component(plan: &AllocationPlan, i: usize, c: &Component) -> Result<(), Violation> {
    let label = c.label();
    if let Some(name) = &c.name
        && !is_identifier(name)
    {
        return Err(violation(
            format!(
                "component name `{name}` is not an identifier (letters, digits, `_`, not \
                 starting with a digit)"
            ),
            fixed(plan, |p| p.components[i].name = Some(fresh_name(plan, i))),
        ));
    }
    if c.groups.is_empty() {
        return Err(violation(
            format!("component `{label}` has no groups"),
            format!("{}:d1", c.backend),
        ));
    }
    for (g, group) in c.groups.iter().enumerate() {
        check_sizes(plan, i, g, &group.parallel)?;
    }
    match c.role() {
        Role::Inference => check_inference(plan, i, c)?,
        Role::Training => check_training(plan, i, c)?,
    }
    let world = c.world_size();
    if world > MAX_GPUS {
        return Err(violation(
            format!("component `{label}` needs {world} GPUs, more than the supported {MAX_GPUS}"),
            format!("{}:d8", c.backend),
        ));
    }
    Ok(())
}

fn check_sizes(plan: &AllocationPlan, i: usize, g: usize, p: &Parallel) -> Result<(), Violation> {
    let dims = [
        ("dp", p.dp),
        ("tp", p.tp),
        ("pp", p.pp),
        ("cp", p.cp),
        ("ep", p.ep),
        ("etp", p.etp),
    ];
    for (dim, value) in dims {
        if value == 0 {
            let label = plan.components[i].label();
            return Err(violation(
                format!("`{dim}` of group {g} of `{label}` is 0; sizes are at least 1"),
                fixed(plan, |p| {
                    let par = &mut p.components[i].groups[g].parallel;
                    for field in [
                        &mut par.dp,
                        &mut par.tp,
                        &mut par.pp,
                        &mut par.cp,
                        &mut par.ep,
                        &mut par.etp,
                    ] {
                        *field = (*field).max(1);
                    }
                }),
            ));
        }
    }
    Ok(())
}

fn check_inference(plan: &AllocationPlan, i: usize, c: &Component) -> Result<(), Violation> {
    let label = c.label();
    for (g, group) in c.groups.iter().enumerate() {
        let p = group.parallel;
        if group.worker_type == WorkerType::Train {
            return Err(violation(
                format!(
                    "inference backend `{}` cannot have a `train` group; use regular, prefill \
                     or decode",
                    c.backend
                ),
                fixed(plan, |p| {
                    p.components[i].groups[g].worker_type = WorkerType::Regular;
                }),
            ));
        }
        if p.cp != 1 || p.ep != 1 || p.etp != 1 {
            return Err(violation(
                format!(
                    "inference backend `{}` takes only d, t, p (group {g} of `{label}` has \
                     cp={} ep={} etp={}); set expert/attention options in the engine config",
                    c.backend, p.cp, p.ep, p.etp
                ),
                fixed(plan, |p| {
                    let par = &mut p.components[i].groups[g].parallel;
                    (par.cp, par.ep, par.etp) = (1, 1, 1);
                }),
            ));
        }
    }
    if !c.is_pd() {
        if c.groups.len() != 1 {
            return Err(violation(
                format!(
                    "`{label}` has {} regular groups; a plain inference component has exactly \
                     one, use prefill/decode sections for several",
                    c.groups.len()
                ),
                format!("{}:(prefill:d1t2|decode:d2)", Backend::Sglang),
            ));
        }
        return Ok(());
    }
    check_pd(plan, i, c)
}

fn check_pd(plan: &AllocationPlan, i: usize, c: &Component) -> Result<(), Violation> {
    let label = c.label();
    if !c.backend.supports_pd() {
        return Err(violation(
            format!(
                "backend `{}` of `{label}` cannot run prefill/decode groups; PD needs sglang or \
                 troupe",
                c.backend
            ),
            fixed(plan, |p| p.components[i].backend = Backend::Sglang),
        ));
    }
    if let Some((g, group)) = c
        .groups
        .iter()
        .enumerate()
        .find(|(_, g)| g.worker_type == WorkerType::Regular)
    {
        return Err(violation(
            format!(
                "`{label}` mixes a regular group (group {g}, {}) with prefill/decode groups",
                group.parallel.dims_string("dtp")
            ),
            fixed(plan, |p| {
                p.components[i].groups[g].worker_type = WorkerType::Decode;
            }),
        ));
    }
    if let Some((g, group)) = c
        .groups
        .iter()
        .enumerate()
        .find(|(_, g)| g.parallel.pp != 1)
    {
        return Err(violation(
            format!(
                "prefill/decode groups need p = 1, the {} group of `{label}` has p{}",
                group.worker_type, group.parallel.pp
            ),
            fixed(plan, |p| {
                let par = &mut p.components[i].groups[g].parallel;
                par.tp = par.tp.saturating_mul(par.pp);
                par.pp = 1;
            }),
        ));
    }
    for needed in [WorkerType::Prefill, WorkerType::Decode] {
        if !c.groups.iter().any(|g| g.worker_type == needed) {
            return Err(violation(
                format!(
                    "`{label}` has no {needed} group; PD needs at least one prefill and one decode server"
                ),
                fixed(plan, |p| {
                    p.components[i]
                        .groups
                        .push(crate::plan::Group::new(needed, Parallel::default()));
                }),
            ));
        }
    }
    Ok(())
}

fn check_training(plan: &AllocationPlan, i: usize, c: &Component) -> Result<(), Violation> {
    let label = c.label();
    let group = match c.groups.as_slice() {
        [group] if group.worker_type == WorkerType::Train => group,
        _ => {
            return Err(violation(
                format!(
                    "training backend `{}` takes exactly one `train` group, `{label}` has {} \
                     group(s) of type(s) {}",
                    c.backend,
                    c.groups.len(),
                    c.groups
                        .iter()
                        .map(|g| g.worker_type.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                format!("{}:d8", c.backend),
            ));
        }
    };
    let p = group.parallel;
    if c.backend == Backend::Fsdp && (p.pp != 1 || p.ep != 1 || p.etp != 1) {
        let what = if p.pp != 1 {
            format!("pipeline parallel (p{})", p.pp)
        } else {
            format!("expert parallel (e{}, etp{})", p.ep, p.etp)
        };
        return Err(violation(
            format!(
                "FSDP does not support {what} in `{label}`; FSDP takes d, t, c; use megatron or \
                 archon for p and e"
            ),
            fixed(plan, |p| p.components[i].backend = Backend::Megatron),
        ));
    }
    if p.ep != 1 || p.etp != 1 {
        let emp = p.expert_model_parallel_size();
        let world = p.world_size();
        if emp == 0 || !world.is_multiple_of(emp) {
            return Err(violation(
                format!(
                    "expert model parallel size p·etp·e = {}·{}·{} = {emp} of `{label}` does not \
                     divide its world size {world}",
                    p.pp, p.etp, p.ep
                ),
                fixed(plan, |p| {
                    let par = &mut p.components[i].groups[0].parallel;
                    par.dp = par.dp.saturating_mul(u32::try_from(emp).unwrap_or(1));
                }),
            ));
        }
    }
    Ok(())
}

fn check_names(plan: &AllocationPlan) -> Result<(), Violation> {
    let mut seen = BTreeSet::new();
    for (i, c) in plan.components.iter().enumerate() {
        if let Some(name) = &c.name
            && !seen.insert(name.as_str())
        {
            return Err(violation(
                format!("duplicate component name `{name}`; names must be unique"),
                fixed(plan, |p| p.components[i].name = Some(fresh_name(plan, i))),
            ));
        }
    }
    // AReaL: a disaggregated allocation (`+`) of 3 or more components names all of them;
    // one colocation group alone may keep its anchor unnamed.
    let pools = plan
        .components
        .iter()
        .filter(|c| c.colocate_with.is_none())
        .count();
    if plan.components.len() >= 3 && pools >= 2 {
        let unnamed: Vec<String> = plan
            .components
            .iter()
            .filter(|c| c.name.is_none())
            .map(ToString::to_string)
            .collect();
        if !unnamed.is_empty() {
            return Err(violation(
                format!(
                    "with 3 or more components all must be named; unnamed: {}",
                    few(&unnamed)
                ),
                fixed(plan, name_all),
            ));
        }
    }
    Ok(())
}

fn check_colocation(plan: &AllocationPlan) -> Result<(), Violation> {
    for (i, c) in plan.components.iter().enumerate() {
        let Some(target) = c.colocate_with.as_deref() else {
            continue;
        };
        let label = c.label();
        if c.name.is_none() {
            return Err(violation(
                format!("colocated component `{label}` must be named"),
                fixed(plan, name_all),
            ));
        }
        let Some(t) = plan.component_index(target) else {
            return Err(violation(
                format!("`{label}` colocates with `{target}`, but no component has that name"),
                fixed(plan, |p| p.components[i].colocate_with = None),
            ));
        };
        let anchor = &plan.components[t];
        if t == i || anchor.colocate_with.is_some() {
            return Err(violation(
                format!(
                    "`{label}` colocates with `{target}`, which is itself colocated; colocate \
                     every member with the component that owns the GPUs"
                ),
                fixed(plan, |p| {
                    p.components[i].colocate_with = if t == i {
                        None
                    } else {
                        anchor.colocate_with.clone()
                    };
                }),
            ));
        }
        let (aw, cw) = (anchor.world_size(), c.world_size());
        if aw != cw {
            return Err(violation(
                format!(
                    "colocated components must have equal world sizes: `{}` has {aw}, `{label}` \
                     has {cw}",
                    anchor.label()
                ),
                fixed(plan, |p| resize_to(&mut p.components[i], aw)),
            ));
        }
    }
    Ok(())
}

/// Best-effort fix for a colocated world-size mismatch: scale the first group's `d`.
fn resize_to(c: &mut Component, world: u64) {
    let others: u64 = c
        .groups
        .iter()
        .skip(1)
        .fold(0u64, |a, g| a.saturating_add(g.world_size()));
    if let Some(first) = c.groups.first_mut() {
        let per_dp = first.world_size() / u64::from(first.parallel.dp.max(1));
        let want = world.saturating_sub(others);
        if per_dp > 0 && want.is_multiple_of(per_dp) && want > 0 {
            first.parallel.dp = u32::try_from(want / per_dp).unwrap_or(first.parallel.dp);
        }
    }
}
