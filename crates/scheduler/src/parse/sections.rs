//! Sectioned bodies: PD groups `(prefill:…|decode:…)` and MoE hybrid `(attn:…|ffn:…)`.

use super::cursor::Cursor;
use super::dims::{Dims, parse_dims};
use crate::backend::{Backend, Role, WorkerType};
use crate::error::SchedulerError;
use crate::parallel::Parallel;
use crate::plan::{Component, Group};

/// What a section name stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SectionKind {
    Attn,
    Ffn,
    Prefill,
    Decode,
}

impl SectionKind {
    fn from_name(name: &str) -> Option<SectionKind> {
        match name {
            "attn" => Some(SectionKind::Attn),
            "ffn" => Some(SectionKind::Ffn),
            "prefill" | "P" => Some(SectionKind::Prefill),
            "decode" | "D" => Some(SectionKind::Decode),
            _ => None,
        }
    }

    fn is_pd(self) -> bool {
        matches!(self, SectionKind::Prefill | SectionKind::Decode)
    }

    fn allowed(self) -> &'static str {
        match self {
            SectionKind::Attn => "dtpc",
            SectionKind::Ffn => "dtpe",
            SectionKind::Prefill | SectionKind::Decode => "dtp",
        }
    }
}

/// One parsed section with its position (for messages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Section {
    kind: SectionKind,
    dims: Dims,
    at: usize,
}

/// Whether the cursor is at `<section name>:` (without consuming anything).
pub(crate) fn at_section(cur: &mut Cursor<'_>) -> bool {
    let save = cur.pos();
    let found = cur
        .ident()
        .is_some_and(|name| SectionKind::from_name(&name).is_some())
        && cur.peek() == Some(':');
    cur.set_pos(save);
    found
}

fn suggest_section(name: &str) -> &'static str {
    match name.to_ascii_lowercase().as_str() {
        "p" | "pre" | "prefil" | "prefill" => "prefill",
        "d" | "dec" | "decod" | "decode" => "decode",
        "att" | "attention" | "attn" => "attn",
        "ff" | "mlp" | "expert" | "experts" | "moe" | "ffn" => "ffn",
        _ => "prefill",
    }
}

/// Parses `name:dims|name:dims…`. With `parens` the list ends at `)`; without, it ends at the
/// first `|` not followed by a section name (which then belongs to colocation).
pub(crate) fn parse_sections(
    cur: &mut Cursor<'_>,
    parens: bool,
) -> Result<Vec<Section>, SchedulerError> {
    let mut sections = Vec::new();
    loop {
        cur.peek();
        let at = cur.pos();
        let Some(name) = cur.ident() else {
            let found = cur.found();
            return Err(cur.error(
                format!(
                    "expected a section such as `prefill:`, `decode:`, `attn:` or `ffn:`, found \
                     {found}"
                ),
                "sglang:(prefill:d2t2|decode:d4t1)",
            ));
        };
        let end = cur.pos();
        let Some(kind) = SectionKind::from_name(&name) else {
            let fix = suggest_section(&name);
            return Err(cur.error_at(
                at,
                format!(
                    "unknown section `{name}`; sections are `prefill` (or `P`) and `decode` (or \
                     `D`) for PD inference, `attn` and `ffn` for MoE training"
                ),
                cur.splice(at, end, fix),
            ));
        };
        if !cur.eat(':') {
            let found = cur.found();
            let pos = cur.pos();
            return Err(cur.error_at(
                pos,
                format!("expected `:` after section `{name}`, found {found}"),
                cur.splice(end, end, ":"),
            ));
        }
        let context = format!("the `{name}` section");
        let dims = parse_dims(cur, kind.allowed(), &context)?;
        sections.push(Section { kind, dims, at });
        if parens {
            if cur.eat('|') {
                continue;
            }
            if cur.eat(')') {
                break;
            }
            let found = cur.found();
            let pos = cur.pos();
            return Err(cur.error_at(
                pos,
                format!("expected `|` or `)` after a section, found {found}"),
                cur.splice(pos, pos, ")"),
            ));
        }
        let save = cur.pos();
        if cur.eat('|') && at_section(cur) {
            continue;
        }
        cur.set_pos(save);
        break;
    }
    Ok(sections)
}

/// Turns sections into the groups of `component` (PD) or its single train group (hybrid).
/// `splice` replaces the component in the original mode, to build corrected examples.
pub(crate) fn build_groups(
    cur: &Cursor<'_>,
    component: &Component,
    sections: &[Section],
    splice: &dyn Fn(&str) -> String,
) -> Result<Vec<Group>, SchedulerError> {
    let backend = component.backend;
    let first = sections.first().map(|s| s.kind);
    if let Some(mixed) = sections
        .iter()
        .find(|s| Some(s.kind.is_pd()) != first.map(SectionKind::is_pd))
    {
        return Err(cur.error_at(
            mixed.at,
            "prefill/decode sections and attn/ffn sections cannot be mixed in one component",
            "sglang:(prefill:d2t2|decode:d4t1)+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        ));
    }
    if first.is_some_and(SectionKind::is_pd) {
        if backend.role() == Role::Training {
            let fixed = Component {
                backend: Backend::Sglang,
                ..component.clone()
            };
            let groups = pd_groups(sections);
            let fixed = Component { groups, ..fixed };
            return Err(cur.error_at(
                sections[0].at,
                format!(
                    "prefill/decode sections are for inference backends sglang and troupe; \
                     `{backend}` is a training backend"
                ),
                splice(&fixed.to_string()),
            ));
        }
        return Ok(pd_groups(sections));
    }
    if !backend.supports_hybrid() {
        let megatron = Component {
            backend: Backend::Megatron,
            ..component.clone()
        };
        let example = match hybrid_group(cur, &megatron, sections, splice) {
            Ok(group) => splice(
                &Component {
                    groups: vec![group],
                    ..megatron
                }
                .to_string(),
            ),
            Err(_) => "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)".to_string(),
        };
        return Err(cur.error_at(
            sections.first().map_or(0, |s| s.at),
            format!(
                "the MoE hybrid form (attn:…|ffn:…) is for training backends (fsdp, megatron, \
                 archon), not `{backend}`"
            ),
            example,
        ));
    }
    // AReaL's grammar: `attn` comes first, then `ffn`.
    if let [first, second, ..] = sections
        && first.kind == SectionKind::Ffn
        && second.kind == SectionKind::Attn
    {
        return Err(cur.error_at(
            first.at,
            "in the MoE hybrid form the `attn` section comes first, then `ffn`",
            format!("{backend}:(attn:{}|ffn:{})", second.dims, first.dims),
        ));
    }
    hybrid_group(cur, component, sections, splice).map(|g| vec![g])
}

fn pd_groups(sections: &[Section]) -> Vec<Group> {
    sections
        .iter()
        .map(|s| {
            let worker_type = if s.kind == SectionKind::Prefill {
                WorkerType::Prefill
            } else {
                WorkerType::Decode
            };
            let parallel = Parallel {
                dp: s.dims.d.unwrap_or(1),
                tp: s.dims.t.unwrap_or(1),
                pp: s.dims.p.unwrap_or(1),
                ..Parallel::default()
            };
            Group::new(worker_type, parallel)
        })
        .collect()
}

fn hybrid_group(
    cur: &Cursor<'_>,
    component: &Component,
    sections: &[Section],
    splice: &dyn Fn(&str) -> String,
) -> Result<Group, SchedulerError> {
    let example = "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)";
    let mut attn = None;
    let mut ffn = None;
    for s in sections {
        let slot = if s.kind == SectionKind::Attn {
            &mut attn
        } else {
            &mut ffn
        };
        if slot.is_some() {
            return Err(cur.error_at(
                s.at,
                "the MoE hybrid form takes exactly one `attn` and one `ffn` section",
                example,
            ));
        }
        *slot = Some(s.dims);
    }
    let (Some(attn), Some(ffn)) = (attn, ffn) else {
        return Err(cur.error_at(
            sections.first().map_or(0, |s| s.at),
            "the MoE hybrid form needs both an `attn` and an `ffn` section",
            example,
        ));
    };
    let rule = |message: String, example: String| SchedulerError::Rule {
        mode: cur.input().to_string(),
        message,
        example,
    };
    let base = Parallel {
        dp: attn.d.unwrap_or(1),
        tp: attn.t.unwrap_or(1),
        pp: attn.p.unwrap_or(1),
        cp: attn.c.unwrap_or(1),
        ep: ffn.e.unwrap_or(1),
        etp: ffn.t.unwrap_or(1),
    };
    let with = |parallel: Parallel| {
        let fixed = Component {
            groups: vec![Group::new(WorkerType::Train, parallel)],
            ..component.clone()
        };
        splice(&fixed.to_string())
    };
    let attn_world = base.world_size();
    if let Some(ffn_pp) = ffn.p
        && ffn_pp != base.pp
    {
        return Err(rule(
            format!(
                "pipeline parallel size of attn and ffn must be identical, got attn p{} and ffn \
                 p{ffn_pp}",
                base.pp
            ),
            with(base),
        ));
    }
    let non_dp = u64::from(base.ep)
        .saturating_mul(u64::from(base.etp))
        .saturating_mul(u64::from(base.pp));
    let ffn_dp = match ffn.d {
        Some(d) => u64::from(d),
        None if non_dp > 0 && attn_world.is_multiple_of(non_dp) => attn_world / non_dp,
        None => {
            return Err(rule(
                format!(
                    "cannot derive ffn d: attn world size {attn_world} is not divisible by ffn \
                     e·t·p = {non_dp}"
                ),
                example.to_string(),
            ));
        }
    };
    let ffn_world = ffn_dp.saturating_mul(non_dp);
    if ffn_world != attn_world {
        let fix = if non_dp > 0 && attn_world.is_multiple_of(non_dp) {
            with(base)
        } else {
            example.to_string()
        };
        return Err(rule(
            format!(
                "world sizes of attn ({attn_world}) and ffn ({ffn_world}) must match; omit ffn \
                 `d` to derive it"
            ),
            fix,
        ));
    }
    Ok(Group::new(WorkerType::Train, base))
}
