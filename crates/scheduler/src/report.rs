//! Renders a plan (and optionally its placement) as the `troupe alloc` table or JSON object.

use serde::Serialize;

use crate::backend::{Backend, Role, WorkerType};
use crate::placement::{PlacedInstance, Placement};
use crate::plan::AllocationPlan;

#[derive(Serialize)]
struct JsonReport<'a> {
    world_size: u64,
    mode: String,
    components: Vec<JsonComponent>,
    #[serde(skip_serializing_if = "Option::is_none")]
    placement: Option<&'a [PlacedInstance]>,
}

#[derive(Serialize)]
struct JsonComponent {
    backend: Backend,
    name: Option<String>,
    role: Role,
    world_size: u64,
    colocate_with: Option<String>,
    groups: Vec<JsonGroup>,
}

#[derive(Serialize)]
struct JsonGroup {
    worker_type: WorkerType,
    dp: u32,
    tp: u32,
    pp: u32,
    cp: u32,
    ep: u32,
    etp: u32,
    instances: u64,
    gpus_per_instance: u64,
    world_size: u64,
}

/// The single JSON object (one line) printed by `troupe alloc --json`.
pub(crate) fn json(
    plan: &AllocationPlan,
    placement: Option<&Placement>,
) -> Result<String, serde_json::Error> {
    let components = plan
        .components
        .iter()
        .map(|c| JsonComponent {
            backend: c.backend,
            name: c.name.clone(),
            role: c.role(),
            world_size: c.world_size(),
            colocate_with: c.colocate_with.clone(),
            groups: c
                .groups
                .iter()
                .map(|g| JsonGroup {
                    worker_type: g.worker_type,
                    dp: g.parallel.dp,
                    tp: g.parallel.tp,
                    pp: g.parallel.pp,
                    cp: g.parallel.cp,
                    ep: g.parallel.ep,
                    etp: g.parallel.etp,
                    instances: g.instances(),
                    gpus_per_instance: g.gpus_per_instance(),
                    world_size: g.world_size(),
                })
                .collect(),
        })
        .collect();
    let report = JsonReport {
        world_size: plan.world_size(),
        mode: plan.to_string(),
        components,
        placement: placement.map(|p| p.instances.as_slice()),
    };
    serde_json::to_string(&report)
}

/// Left-aligned columns separated by two spaces, indented by two; no trailing spaces.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        format!("  {}", padded.join("  ").trim_end())
    };
    let mut out = vec![line(header.iter().map(ToString::to_string).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

/// `0-3` for a contiguous run of 3 or more, else `0,1`.
fn gpu_list(gpus: &[u32]) -> String {
    let contiguous = gpus.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
    match (gpus.first(), gpus.last()) {
        (Some(first), Some(last)) if gpus.len() >= 3 && contiguous => format!("{first}-{last}"),
        _ => gpus
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// The readable table printed by `troupe alloc`.
pub(crate) fn text(plan: &AllocationPlan, placement: Option<(&Placement, String)>) -> String {
    let mut out = vec![
        format!("mode: {plan}"),
        format!("GPUs: {}", plan.world_size()),
        String::new(),
        "components".to_string(),
    ];
    let rows: Vec<Vec<String>> = plan
        .components
        .iter()
        .enumerate()
        .map(|(i, c)| {
            vec![
                i.to_string(),
                c.backend.to_string(),
                opt(c.name.clone()),
                c.role().to_string(),
                c.world_size().to_string(),
                opt(c.colocate_with.clone()),
            ]
        })
        .collect();
    out.push(table(
        &["#", "backend", "name", "role", "world", "colocate_with"],
        &rows,
    ));
    out.push(String::new());
    out.push("groups".to_string());
    let mut rows = Vec::new();
    for (i, c) in plan.components.iter().enumerate() {
        for (g, group) in c.groups.iter().enumerate() {
            let p = group.parallel;
            rows.push(vec![
                i.to_string(),
                g.to_string(),
                group.worker_type.to_string(),
                group.instances().to_string(),
                group.gpus_per_instance().to_string(),
                p.dp.to_string(),
                p.tp.to_string(),
                p.pp.to_string(),
                p.cp.to_string(),
                p.ep.to_string(),
                p.etp.to_string(),
                group.world_size().to_string(),
            ]);
        }
    }
    out.push(table(
        &[
            "comp",
            "group",
            "type",
            "instances",
            "gpus/inst",
            "dp",
            "tp",
            "pp",
            "cp",
            "ep",
            "etp",
            "world",
        ],
        &rows,
    ));
    if let Some((placement, title)) = placement {
        out.push(String::new());
        out.push(title);
        let rows: Vec<Vec<String>> = placement
            .instances
            .iter()
            .map(|e| {
                vec![
                    e.component.to_string(),
                    e.group.to_string(),
                    e.instance.to_string(),
                    e.worker_type.to_string(),
                    e.host.to_string(),
                    format!("{}/{}", e.node_rank, e.nnodes),
                    gpu_list(&e.gpus),
                    opt(e.ports.http),
                    opt(e.ports.dist),
                    opt(e.ports.bootstrap),
                    opt(e.dist_init_addr.clone()),
                ]
            })
            .collect();
        out.push(table(
            &[
                "comp",
                "group",
                "inst",
                "type",
                "host",
                "node",
                "gpus",
                "http",
                "dist",
                "bootstrap",
                "dist_init_addr",
            ],
            &rows,
        ));
    }
    out.join("\n")
}
