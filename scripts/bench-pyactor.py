"""Python actor calls, one line per figure (`name value`): Troupe's `troupe.python` actors
(in-process host, and a `troupe host` subprocess over gRPC) beside Ray's Python actors when
`ray` is importable, measured in the same run.

    .venv/bin/python scripts/bench-pyactor.py [--calls 2000]

Figures: sequential calls (`call_sync` / `ray.get(a.m.remote())`): p50 latency and calls/s;
pipelined (`asyncio.gather` of N `call`s / `ray.get([...])`): calls/s; and the ratios.
"""

import argparse
import asyncio
import statistics
import time

import troupe


class Echo:
    def ping(self, x=None):
        return x


def seq(fn, n):
    for _ in range(min(200, n)):
        fn()
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    return statistics.median(lat) * 1e6, n / total


def troupe_figures(name, cluster, n):
    a = cluster.host(0).spawn(Echo)
    p50, rate = seq(lambda: a.call_sync("ping", 1), n)
    print(f"troupe.pyactor.{name}.seq.p50_us {p50:.0f}")
    print(f"troupe.pyactor.{name}.seq.calls_per_s {rate:.0f}")

    async def burst():
        t = time.perf_counter()
        await asyncio.gather(*(a.call("ping", 1) for _ in range(n)))
        return n / (time.perf_counter() - t)

    asyncio.run(burst())
    piped = asyncio.run(burst())
    print(f"troupe.pyactor.{name}.pipelined.calls_per_s {piped:.0f}")
    a.stop()
    return rate, piped


def ray_figures(n):
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        a = ray.remote(Echo).remote()
        ray.get(a.ping.remote(1))
        p50, rate = seq(lambda: ray.get(a.ping.remote(1)), n)
        print(f"ray.pyactor.seq.p50_us {p50:.0f}")
        print(f"ray.pyactor.seq.calls_per_s {rate:.0f}")
        ray.get([a.ping.remote(1) for _ in range(n)])
        t = time.perf_counter()
        ray.get([a.ping.remote(1) for _ in range(n)])
        piped = n / (time.perf_counter() - t)
        print(f"ray.pyactor.pipelined.calls_per_s {piped:.0f}")
        return rate, piped
    finally:
        ray.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    n = ap.parse_args().calls
    with troupe.Cluster.in_process(1, 1) as c:
        inproc = troupe_figures("inprocess", c, n)
    with troupe.Cluster.local_processes(1, 1) as c:
        sub = troupe_figures("subprocess", c, n)
    r = ray_figures(n)
    if r is not None:
        print(f"troupe_vs_ray.pyactor.seq.ratio {sub[0] / r[0]:.2f}")
        print(f"troupe_vs_ray.pyactor.pipelined.ratio {sub[1] / r[1]:.2f}")
        print(f"troupe_vs_ray.pyactor.inprocess_seq.ratio {inproc[0] / r[0]:.2f}")


if __name__ == "__main__":
    main()
