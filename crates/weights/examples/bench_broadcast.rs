//! Runs the chain-broadcast benchmark without the `troupe` CLI:
//! `cargo run --release -p troupe-weights --example bench_broadcast -- 1,2,4,8 512 [fp8]`.

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_broadcast RECEIVERS(e.g. 1,2,4,8) MIB [fp8]";
    let receivers = args
        .first()
        .ok_or(usage)?
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|e| format!("{usage}: {s:?}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mib = args
        .get(1)
        .ok_or(usage)?
        .parse::<usize>()
        .map_err(|e| format!("{usage}: {e}"))?;
    let fp8 = args.get(2).is_some_and(|a| a == "fp8");
    for (k, v) in troupe_weights::broadcast_bench::bench_broadcast(&receivers, mib, fp8).await? {
        println!("{k} {v}");
    }
    Ok(())
}
