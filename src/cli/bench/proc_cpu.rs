//! CPU time of processes and threads, from `/proc`: what the benchmarks divide by the work done
//! to report CPU per request or per call, the figure that holds on a shared, noisy machine
//! where latencies do not.

use std::collections::HashMap;

/// Clock ticks per second of `/proc/<pid>/stat` times.
fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|h| *h > 0)
        .unwrap_or(100) as f64
}

/// CPU time so far (user + system, in s) and start time (s since boot) of process `pid`
/// (`self` for this one), from `/proc/<pid>/stat`.
pub fn proc_times(pid: &str) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the parenthesised command name: state is field 3; utime 14, stime 15 and
    // starttime 22 (1-based, man proc).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |i: usize| -> Option<f64> { fields.get(i - 3)?.parse().ok() };
    let hz = clock_ticks();
    Some(((field(14)? + field(15)?) / hz, field(22)? / hz))
}

/// Seconds the threads of process `pid` (`self` for this one) have run, from the scheduler's
/// own nanosecond accounting (`/proc/<pid>/task/*/schedstat`; `/proc/<pid>/stat` counts in 10 ms
/// ticks): all of them, or with `named` only those whose name starts with it. A thread that
/// ends while this reads is left out. `None` when the process or the file is not there.
pub fn run_time(pid: &str, named: Option<&str>) -> Option<f64> {
    let each = thread_times(pid, named)?;
    (!each.is_empty()).then(|| each.values().sum::<u64>() as f64 / 1e9)
}

/// Nanoseconds each thread of `pid` (as [`run_time`] selects them) has run, by thread id: two
/// snapshots give the CPU those threads spent between them ([`spent`]), unaffected by threads
/// that started or ended in between (another test's gateway in the same process, say).
pub fn thread_times(pid: &str, named: Option<&str>) -> Option<HashMap<String, u64>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut out = HashMap::new();
    for t in tasks.flatten() {
        if let Some(prefix) = named
            && !std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        if let Some(n) = stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        {
            out.insert(t.file_name().to_string_lossy().into_owned(), n);
        }
    }
    Some(out)
}

/// Seconds the threads present in both snapshots ran between them.
pub fn spent(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> f64 {
    after
        .iter()
        .filter_map(|(tid, b)| before.get(tid).map(|a| b.saturating_sub(*a)))
        .sum::<u64>() as f64
        / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn run_times_are_read_to_the_nanosecond() {
        // A process that only started and went to sleep ran for well under one 10 ms tick,
        // which `/proc/<pid>/stat` rounds to nothing; its threads' run times do not.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id().to_string();
        // A task's run time is brought up to date when it leaves the CPU: poll until it has.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut ran = 0.0;
        while ran == 0.0 && Instant::now() < deadline {
            ran = run_time(&pid, None).expect("schedstat readable");
            std::thread::yield_now();
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(ran > 0.0 && ran < 1.0, "{ran}");
        assert_eq!(run_time("no-such-process", None), None);
    }

    #[test]
    fn threads_are_counted_by_name() {
        // Spins until this thread has run 30 ms on a CPU (its own schedstat, not the code under
        // test): 30 ms of wall time is less CPU time than that when the cores are shared.
        let spin_cpu = |ns: u64| {
            let ran = || {
                std::fs::read_to_string("/proc/thread-self/schedstat")
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            while ran() < ns && Instant::now() < deadline {
                for _ in 0..10_000 {
                    std::hint::spin_loop();
                }
            }
        };
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::Builder::new()
            .name("proc-cpu-probe".into())
            .spawn(move || {
                spin_cpu(30_000_000);
                let _ = rx.recv();
            })
            .expect("thread starts");
        // The probe thread spun 30 ms before it sleeps; poll until its time shows.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut probe = 0.0;
        while probe < 0.02 && Instant::now() < deadline {
            probe = run_time("self", Some("proc-cpu-probe")).unwrap_or(0.0);
            std::thread::sleep(Duration::from_millis(5));
        }
        let all = run_time("self", None).unwrap_or(0.0);
        let none = run_time("self", Some("no-thread-has-this-name")).unwrap_or(0.0);
        let _ = tx.send(());
        let _ = worker.join();
        assert!(probe >= 0.02, "{probe}");
        assert!(all > probe, "all threads {all} vs one {probe}");
        assert_eq!(none, 0.0);
    }
}
