"""The Python examples learn their task: examples/python/grpo.py (`troupe run`'s GRPO loop in
Python), examples/python/torch_grpo.py (a 2-rank PyTorch trainer group) and
examples/python/agent_grpo.py (an `openai`-SDK agent trained through recorded gateway sessions)."""

import json
import pathlib
import subprocess
import sys

from conftest import need_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def example(name, *args, timeout=280):
    """Runs examples/python/`name` with `args`; the finished process."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples/python" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def trained(name, tmp_path, steps=14, *overrides):
    """Runs a GRPO example for `steps` steps and returns its summary, checking it learned."""
    out = tmp_path / "run.json"
    p = example(name, f"train.steps={steps}", *overrides, "--summary", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    # A clean exit: no episode outlives the rollout controller (none touches Python late).
    assert "Traceback" not in p.stderr and "panicked" not in p.stderr, p.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == steps and s["weight_format"] == "fp8"
    assert s["final_reward"] > s["baseline_reward"] + 0.1, s["rewards"]
    assert f"step  {steps}" in p.stdout
    return s


def test_the_python_grpo_example_raises_the_reward(tmp_path):
    trained("grpo.py", tmp_path)


def test_the_agent_grpo_example_trains_an_sdk_agent(tmp_path):
    trained("agent_grpo.py", tmp_path, steps=AGENT_STEPS)


#: Steps the agent example needs to show its reward rising (see docs/benchmarks.md's row).
AGENT_STEPS = 10


def test_the_python_grpo_example_names_a_bad_override():
    p = example("grpo.py", "train.stepz=3", timeout=60)
    assert p.returncode == 2 and "stepz" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_pytorch_grpo_example_trains_with_a_two_rank_group(tmp_path):
    need_torch()
    # weights.delta=on (engines on this machine read the ring, where `auto` sends every byte):
    # the summary reports each sync's bytes and the fraction of values that changed. This
    # example's learning rate moves most of the tiny model's FP8 values every step, so its
    # syncs go whole (a delta would not pay); tests/weights/sync.rs and the real-vLLM GRPO
    # test show deltas that do. A tensor whose delta did not pay goes plain for the next 1, 2,
    # 4, then 8 syncs, which measure nothing (changed_fraction None) and cost no more than full.
    s = trained("torch_grpo.py", tmp_path, 14, "weights.delta=on")
    assert s["ranks"] == 2
    full, sent, seen = s["sync_bytes_full"], s["sync_bytes_sent"], s["changed_fraction"][1:]
    assert s["weights_delta"] == "on" and len(sent) == s["steps"] + 1 and sent[0] >= full
    assert all(f is None or 0.0 < f <= 1.0 for f in seen), seen
    assert seen[0] is not None and seen[0] > 0.2, seen
    assert any(f is None for f in seen), "dense tensors back off: " + str(seen)
    assert all(b < full or f is None or f > 0.2 for b, f in zip(sent[1:], seen)), (full, sent, seen)
    assert all(b <= full * 1.05 for b in sent[1:]), (full, sent)


def test_the_wheel_brings_the_troupe_command(tmp_path):
    """`pip install ./python` is a complete install: its `troupe` script runs the CLI, and the
    package's clusters start their engines with it, without TROUPE_BIN or PATH."""
    import os

    script = pathlib.Path(sys.prefix) / "bin" / "troupe"
    assert script.is_file(), script
    p = subprocess.run(
        [str(script), "alloc", "troupe:d2", "--hosts", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "troupe" in p.stdout, p.stderr
    env = {k: v for k, v in os.environ.items() if k != "TROUPE_BIN"}
    env["PATH"] = "/usr/bin:/bin"
    out = tmp_path / "run.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples/python/grpo.py"), "train.steps=2", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["steps"] == 2


def test_grpo_runs_on_two_real_vllm_servers(tmp_path, vllm_py):
    """examples/python/vllm_grpo.py: rollouts from two real vLLM servers through the gateway,
    new weights into both every step over Troupe's transport (vLLM's four-phase routes into
    Troupe's weight-transfer engine), the staleness bound held."""
    py = vllm_py
    out = tmp_path / "run.json"
    p = subprocess.run(
        # A small learning rate and weights.delta=on: after version 0, each sync into vLLM is a
        # delta that vLLM's workers apply to the buffers they kept (Troupe's transfer engine).
        [str(py), str(ROOT / "examples/python/vllm_grpo.py"), "--steps", "4", "--lr", "1e-5", "--delta", "on", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == 4 and s["engine"] == "vllm" and s["weights"] == "tensor", s
    assert max(s["staleness"]) <= s["max_staleness"], s
    assert len(s["sync_seconds"]) == 4
    assert "step   4 " in p.stdout, p.stdout
    full, sent = s["sync_bytes_full"], s["sync_bytes_sent"]
    assert len(sent) == 5 and sent[0] >= full and any(b < full * 0.85 for b in sent[1:]), (full, sent)
