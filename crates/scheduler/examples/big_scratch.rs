use troupe_scheduler::cli::{AllocArgs, run_alloc};
fn main() {
    for (mode, hosts) in [("sglang:d131072t8", 131072usize), ("fsdp:d1048576", 131072), ("sglang:d65536t16", 131072), ("sglang:(prefill:d100000t2|decode:d400000)", 131072)] {
        let t = std::time::Instant::now();
        let r = run_alloc(&AllocArgs { mode: mode.into(), hosts: Some(hosts), gpus_per_host: 8, json: true });
        println!("{mode}: {:?} bytes in {:?}", r.map(|s| s.len()).map_err(|e| e.to_string().chars().take(200).collect::<String>()), t.elapsed());
    }
}
