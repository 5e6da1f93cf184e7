//! The allocation-mode parser: a small recursive-descent reader of AReaL's grammar plus PD groups.
//!
//! ```text
//! mode      := pool ('+' pool)*                  separate GPU pools
//! pool      := component ('|' component)*        colocated on the first (binds tighter than +)
//! component := BACKEND ('[' NAME ']')? ( ':' body | '(' sections ')' )
//! body      := dims | '(' sections ')' | sections
//! sections  := SECTION ':' dims ('|' SECTION ':' dims)*   SECTION: prefill P decode D attn ffn
//! dims      := (LETTER SIZE)+                    LETTER in d t p c e, SIZE a positive integer
//! ```
//! Whitespace between tokens is ignored. Parsing yields an [`AllocationPlan`] that is then
//! checked by the same rules as every other config path.

mod cursor;
mod dims;
mod sections;

use std::collections::BTreeSet;
use std::str::FromStr;

use self::cursor::Cursor;
use self::dims::parse_dims;
use self::sections::{at_section, build_groups, parse_sections};
use crate::backend::{Backend, Role, WorkerType};
use crate::error::SchedulerError;
use crate::parallel::Parallel;
use crate::plan::{AllocationPlan, Component, Group};

const EXAMPLE: &str = "sglang:d4t2+fsdp:d8";

/// Longest allocation mode accepted: far above any real one (at most
/// [`crate::plan::MAX_COMPONENTS`] components), so parsing and error reporting stay bounded.
const MAX_MODE_CHARS: usize = 4096;

/// The mode-string entry point lives with its parser, so the plan's types (`plan.rs`) need
/// neither the parser nor the rules.
impl AllocationPlan {
    /// Parses an allocation mode such as `sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8`.
    pub fn parse(mode: &str) -> Result<AllocationPlan, SchedulerError> {
        parse_mode(mode)
    }
}

/// `"sglang:d4".parse::<AllocationPlan>()`, the same as [`AllocationPlan::parse`].
impl FromStr for AllocationPlan {
    type Err = SchedulerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AllocationPlan::parse(s)
    }
}

/// Parses and validates an allocation mode.
fn parse_mode(input: &str) -> Result<AllocationPlan, SchedulerError> {
    if input.chars().count() > MAX_MODE_CHARS {
        return Err(SchedulerError::Syntax {
            input: input.to_string(),
            column: MAX_MODE_CHARS + 1,
            message: format!(
                "the allocation mode is {} characters long; at most {MAX_MODE_CHARS} are allowed",
                input.chars().count()
            ),
            example: EXAMPLE.to_string(),
        });
    }
    let mut cur = Cursor::new(input);
    if cur.at_end() {
        return Err(cur.error("the allocation mode is empty", EXAMPLE));
    }
    let mut pools: Vec<Vec<Component>> = Vec::new();
    loop {
        pools.push(parse_pool(&mut cur)?);
        if cur.eat('+') {
            if cur.at_end() {
                let end = cur.pos();
                return Err(cur.error(
                    "expected a component after `+`, found the end of the mode",
                    cur.splice(end, end, "fsdp:d4"),
                ));
            }
            continue;
        }
        if cur.at_end() {
            break;
        }
        let found = cur.found();
        let pos = cur.pos();
        let example = if found == "`)`" {
            cur.splice(pos, pos + 1, "")
        } else {
            EXAMPLE.to_string()
        };
        return Err(cur.error(
            format!(
                "expected `+` (separate GPUs) or `|` (colocate) between components, found {found}"
            ),
            example,
        ));
    }
    // AReaL: in a colocation group the first component is the anchor and may go unnamed;
    // every later one must be named.
    if pools
        .iter()
        .any(|pool| pool.iter().skip(1).any(|c| c.name.is_none()))
    {
        let mut named = pools.clone();
        // With 3+ components across `+`, every name is required, anchors too (see
        // `validate::check_names`); otherwise the anchors may stay unnamed in the example.
        let total: usize = pools.iter().map(Vec::len).sum();
        let keep_anchors = !(total >= 3 && pools.len() >= 2);
        if keep_anchors {
            for pool in &mut named {
                if let Some(first) = pool.first_mut() {
                    first.name = first.name.take().or_else(|| Some(String::new()));
                }
            }
        }
        name_pools(&mut named);
        if keep_anchors {
            for (pool, orig) in named.iter_mut().zip(&pools) {
                if let (Some(first), Some(o)) = (pool.first_mut(), orig.first()) {
                    first.name = o.name.clone();
                }
            }
        }
        return Err(SchedulerError::Rule {
            mode: input.to_string(),
            message: "in a colocation group (joined by `|`) every component after the first \
                      must be named; the first is the anchor the others share GPUs with, as \
                      in `sglang:d4|fsdp[actor]:d4`"
                .to_string(),
            example: flatten(named).to_string(),
        });
    }
    let plan = flatten(pools);
    crate::validate::validate(&plan).map_err(|v| SchedulerError::Rule {
        mode: input.to_string(),
        message: v.message,
        example: v.example,
    })?;
    Ok(plan)
}

/// Flattens pools into components: members after the first colocate with it (by its name, or
/// by `#index` when the anchor is unnamed, as AReaL allows).
fn flatten(pools: Vec<Vec<Component>>) -> AllocationPlan {
    let mut components: Vec<Component> = Vec::new();
    for pool in pools {
        let at = components.len();
        let anchor = pool
            .first()
            .map(|c| c.name.clone().unwrap_or_else(|| format!("#{at}")));
        for (i, mut c) in pool.into_iter().enumerate() {
            if i > 0 {
                c.colocate_with = anchor.clone();
            }
            components.push(c);
        }
    }
    AllocationPlan { components }
}

/// Gives every unnamed component a fresh name (`rollout`, `actor`, `actor2`, …) for examples.
fn name_pools(pools: &mut [Vec<Component>]) {
    let mut taken: BTreeSet<String> = pools
        .iter()
        .flatten()
        .filter_map(|c| c.name.clone())
        .collect();
    for c in pools.iter_mut().flatten() {
        if c.name.is_none() {
            let base = if c.role() == Role::Inference {
                "rollout"
            } else {
                "actor"
            };
            let name = std::iter::once(base.to_string())
                .chain((2..).map(|k| format!("{base}{k}")))
                .find(|n| !taken.contains(n))
                .unwrap_or_else(|| base.to_string());
            taken.insert(name.clone());
            c.name = Some(name);
        }
    }
}

fn parse_pool(cur: &mut Cursor<'_>) -> Result<Vec<Component>, SchedulerError> {
    let mut pool = vec![parse_component(cur)?];
    while cur.eat('|') {
        if cur.at_end() {
            let end = cur.pos();
            return Err(cur.error(
                "expected a component after `|`, found the end of the mode",
                cur.splice(end, end, "fsdp[critic]:d4"),
            ));
        }
        pool.push(parse_component(cur)?);
    }
    Ok(pool)
}

/// Whether `word` reads as bare dimensions (`d4t2`), i.e. a component with its backend missing.
fn looks_like_dims(word: &str) -> bool {
    let mut chars = word.chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if !"dtpce".contains(c) || !chars.peek().is_some_and(char::is_ascii_digit) {
            return false;
        }
        while chars.peek().is_some_and(char::is_ascii_digit) {
            chars.next();
        }
        any = true;
    }
    any
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut row = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            let best = (prev[j] + cost).min(prev[j + 1] + 1).min(row[j] + 1);
            row.push(best);
        }
        prev = row;
    }
    prev.last().copied().unwrap_or(0)
}

/// The backend a misspelt name most likely meant.
fn closest_backend(word: &str) -> Option<Backend> {
    let lower = word.to_ascii_lowercase();
    if let Some(b) = Backend::from_name(&lower) {
        return Some(b);
    }
    Backend::ALL
        .into_iter()
        .map(|b| (edit_distance(&lower, b.as_str()), b))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, b)| b)
}

/// `sglang.d4+fsdp.d4` → `sglang:d4+fsdp:d4`.
fn fix_dots(input: &str) -> String {
    Backend::ALL
        .into_iter()
        .fold(input.replace("].", "]:"), |s, b| {
            s.replace(&format!("{b}."), &format!("{b}:"))
        })
}

fn missing_backend(cur: &Cursor<'_>, start: usize, word: &str) -> SchedulerError {
    let dims_uses_megatron = word.contains('p') || word.contains('e');
    let backend = if dims_uses_megatron {
        "megatron"
    } else {
        "fsdp"
    };
    cur.error_at(
        start,
        format!(
            "`{word}` has no backend; write one before the dimensions: `fsdp:`, `megatron:` or \
             `archon:` for training, `sglang:`, `vllm:` or `troupe:` for inference"
        ),
        cur.splice(start, start, &format!("{backend}:")),
    )
}

fn parse_backend(cur: &mut Cursor<'_>) -> Result<(usize, Backend), SchedulerError> {
    let first = cur.peek();
    let start = cur.pos();
    if first == Some('[') {
        return Err(cur.error_at(
            start,
            "a named component needs a backend before its name, as in `fsdp[actor]:d4`",
            cur.splice(start, start, "fsdp"),
        ));
    }
    if first == Some('(') {
        let rest: String = cur.input().chars().skip(start).collect();
        let backend = if rest.contains("attn") || rest.contains("ffn") {
            "megatron:"
        } else {
            "sglang:"
        };
        return Err(cur.error_at(
            start,
            "a parenthesized form needs a backend before it, as in `megatron:(attn:…|ffn:…)` or \
             `sglang:(prefill:…|decode:…)`",
            cur.splice(start, start, backend),
        ));
    }
    let Some(word) = cur.ident() else {
        let found = cur.found();
        return Err(cur.error(
            format!("expected a backend ({}), found {found}", Backend::names()),
            EXAMPLE,
        ));
    };
    if let Some(b) = Backend::from_name(&word) {
        return Ok((start, b));
    }
    if looks_like_dims(&word) {
        return Err(missing_backend(cur, start, &word));
    }
    if word == "attn" || word == "ffn" {
        return Err(cur.error_at(
            start,
            "the MoE hybrid form needs an explicit backend, as in `megatron:(attn:…|ffn:…)`",
            cur.splice(start, start, "megatron:"),
        ));
    }
    let (hint, example) = match closest_backend(&word) {
        Some(b) => (
            format!(" (did you mean `{b}`?)"),
            cur.splice(start, cur.pos(), b.as_str()),
        ),
        None => (String::new(), EXAMPLE.to_string()),
    };
    Err(cur.error_at(
        start,
        format!(
            "unknown backend `{word}`{hint}; backends are {}",
            Backend::names()
        ),
        example,
    ))
}

fn parse_name(cur: &mut Cursor<'_>) -> Result<Option<String>, SchedulerError> {
    if !cur.eat('[') {
        return Ok(None);
    }
    let Some(name) = cur.ident() else {
        let found = cur.found();
        return Err(cur.error(
            format!("expected a name (letters, digits, `_`) after `[`, found {found}"),
            "sglang[rollout]:d4+fsdp[actor]:d4",
        ));
    };
    if !cur.eat(']') {
        let found = cur.found();
        let pos = cur.pos();
        return Err(cur.error(
            format!("expected `]` after the name `{name}`, found {found}"),
            cur.splice(pos, pos, "]"),
        ));
    }
    Ok(Some(name))
}

fn parse_component(cur: &mut Cursor<'_>) -> Result<Component, SchedulerError> {
    let (start, backend) = parse_backend(cur)?;
    let name = parse_name(cur)?;
    let mut component = Component {
        backend,
        name,
        colocate_with: None,
        groups: Vec::new(),
    };
    let sections = if cur.eat(':') {
        if cur.eat('(') {
            Some(parse_sections(cur, true)?)
        } else if at_section(cur) {
            Some(parse_sections(cur, false)?)
        } else {
            None
        }
    } else if cur.peek() == Some('(') {
        let save = cur.pos();
        cur.bump();
        if let Some(word) = cur.ident()
            && cur.peek() == Some(')')
        {
            return Err(cur.error_at(
                save,
                format!("component names go in brackets: `{backend}[{word}]`"),
                cur.splice(save, cur.pos() + 1, &format!("[{word}]")),
            ));
        }
        cur.set_pos(save + 1);
        Some(parse_sections(cur, true)?)
    } else {
        let found = cur.found();
        let pos = cur.pos();
        let example = if found == "`.`" {
            fix_dots(cur.input())
        } else {
            cur.splice(pos, pos, ":d1")
        };
        return Err(cur.error(
            format!("expected `:` after backend `{backend}`, found {found}"),
            example,
        ));
    };
    component.groups = match sections {
        Some(sections) => {
            let end = cur.pos();
            let cur: &Cursor<'_> = cur;
            let splice = |with: &str| cur.splice(start, end, with);
            build_groups(cur, &component, &sections, &splice)?
        }
        None => {
            let (allowed, context) = match backend.role() {
                Role::Inference => ("dtp", format!("inference backend `{backend}`")),
                Role::Training => ("dtpce", format!("training backend `{backend}`")),
            };
            let dims = parse_dims(cur, allowed, &context)?;
            let parallel = Parallel {
                dp: dims.d.unwrap_or(1),
                tp: dims.t.unwrap_or(1),
                pp: dims.p.unwrap_or(1),
                cp: dims.c.unwrap_or(1),
                ep: dims.e.unwrap_or(1),
                etp: 1,
            };
            let worker_type = match backend.role() {
                Role::Inference => WorkerType::Regular,
                Role::Training => WorkerType::Train,
            };
            vec![Group::new(worker_type, parallel)]
        }
    };
    Ok(component)
}
