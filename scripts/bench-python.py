"""Python-side overhead of the bindings, one line per figure (`name value`):

- generation through `InferenceClient.agenerate` vs plain aiohttp POSTs of the same request to
  the same gateway (sequential latency, and requests/s with 32 in flight), in one run, on the
  tiny model so the engine's own time is small beside the client's;
- a weight update: the trainer actor's weights fetched into numpy and pushed with
  `Service.update_weights`, vs the all-Rust path (`update_weights_from`: trainer actor straight
  to the control plane), and the push alone from numpy arrays already in hand; on the `small`
  model, BF16 and FP8.

    bash scripts/python-env.sh && .venv/bin/python scripts/bench-python.py [--requests 400]

aiohttp figures are printed when aiohttp is importable. Build the extension in release
(`scripts/python-env.sh` does) for meaningful figures.
"""

import argparse
import asyncio
import pathlib
import statistics
import tempfile
import time

import troupe

CONFIG = """allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)'
cluster: {{n_nodes: 1, n_gpus_per_node: 2}}
scheduler: {{type: inprocess}}
sglang: {{model_path: {model}, ready_timeout_s: 120, quantization: "{quant}"}}
"""
BODY_IDS = [5, 6, 7, 8]


async def seq(fn, n):
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        lat.append(time.perf_counter() - t)
    return statistics.median(lat) * 1e6


async def rate(fn, n, conc):
    sem = asyncio.Semaphore(conc)

    async def one():
        async with sem:
            await fn()

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t)


async def generation(url, n):
    client = troupe.InferenceClient(url)

    async def ours():
        await client.agenerate(BODY_IDS, max_new_tokens=1, temperature=0.0)

    await seq(ours, 20)  # warm up
    print(f"py.agenerate.seq_p50_us {await seq(ours, n):.0f}")
    ours_rps = await rate(ours, n, 32)
    print(f"py.agenerate.c32_rps {ours_rps:.0f}")
    try:
        import aiohttp
    except ImportError:
        return
    # The body the Rust client sends (logprobs on: a trainer needs them).
    params = {"max_new_tokens": 1, "temperature": 0.0, "top_p": 1.0, "stop_token_ids": [], "ignore_eos": False}
    body = {"input_ids": BODY_IDS, "sampling_params": params, "return_logprob": True}
    async with aiohttp.ClientSession() as s:

        async def theirs():
            async with s.post(url + "/generate", json=body) as r:
                await r.json()

        await seq(theirs, 20)
        print(f"py.aiohttp.seq_p50_us {await seq(theirs, n):.0f}")
        their_rps = await rate(theirs, n, 32)
        print(f"py.aiohttp.c32_rps {their_rps:.0f}")
        print(f"py.agenerate_vs_aiohttp.c32_ratio {ours_rps / their_rps:.2f}")


def weights(svc, trainer, quant, reps):
    arrays = trainer.get_weights()
    mib = sum(a.nbytes for a in arrays.values()) / 2**20
    print(f"py.update_weights.{quant}.f32_mib {mib:.1f}")
    v = 0

    def timed(fn):
        nonlocal v
        out = []
        for _ in range(reps):
            v += 1
            t = time.perf_counter()
            fn(v)
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    rust = timed(lambda v: svc.update_weights_from(trainer, v))
    numpy = timed(lambda v: svc.update_weights(arrays, v))
    fetch = timed(lambda v: svc.update_weights(trainer.get_weights(), v))
    print(f"py.update_weights.{quant}.rust_ms {rust:.2f}")
    print(f"py.update_weights.{quant}.numpy_ms {numpy:.2f}")
    print(f"py.update_weights.{quant}.numpy_with_get_weights_ms {fetch:.2f}")
    # The same work (fetch the trainer's weights, push them) with and without Python between.
    print(f"py.update_weights.{quant}.python_vs_rust_ratio {fetch / rust:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--updates", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:

        def deployment(model, quant):
            p = pathlib.Path(d) / f"{model}-{quant}.yaml"
            p.write_text(CONFIG.format(model=model, quant="fp8" if quant == "fp8" else ""))
            cfg = troupe.load_config(str(p))
            return troupe.Cluster.from_config(cfg), cfg

        # Generation on the tiny model (the engine's own time small beside the client's).
        cluster, cfg = deployment("tiny", "bf16")
        with cluster, cluster.serve(cfg) as svc:
            asyncio.run(generation(svc.gateway_url, a.requests))
        for quant in ["bf16", "fp8"]:
            cluster, cfg = deployment("small", quant)
            with cluster, cluster.serve(cfg) as svc:
                weights(svc, cluster.spawn_trainer(model="small"), quant, a.updates)


if __name__ == "__main__":
    main()
