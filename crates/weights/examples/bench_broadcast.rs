//! Runs the chain-broadcast benchmark without the `troupe` CLI:
//! `cargo run --release -p troupe-weights --example bench_broadcast -- 1,2,4,8 512 [fp8] [chain]`
//! (`chain`: every receiver on the TCP chain, none on the shared-memory ring).

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_broadcast RECEIVERS(e.g. 1,2,4,8) MIB [fp8] [chain]";
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
    let fp8 = args[2..].iter().any(|a| a == "fp8");
    let ring = if args[2..].iter().any(|a| a == "chain") {
        None
    } else {
        Some(troupe_weights::tcp::shm::DEFAULT_RING_BYTES)
    };
    for (k, v) in
        troupe_weights::broadcast_bench::bench_broadcast(&receivers, mib, fp8, ring).await?
    {
        println!("{k} {v}");
    }
    Ok(())
}
