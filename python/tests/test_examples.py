"""examples/python/grpo.py, `troupe run`'s GRPO loop written in Python, learns its task."""

import json
import pathlib
import subprocess
import sys

from conftest import need_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_python_grpo_example_raises_the_reward(tmp_path):
    out = tmp_path / "run.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples/python/grpo.py"), "train.steps=14", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == 14 and s["weight_format"] == "fp8"
    assert s["final_reward"] > s["baseline_reward"] + 0.1, s["rewards"]
    assert "step  14" in p.stdout


def test_the_python_grpo_example_names_a_bad_override():
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples/python/grpo.py"), "train.stepz=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "stepz" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_pytorch_grpo_example_trains_with_a_two_rank_group(tmp_path):
    need_torch()
    out = tmp_path / "torch.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples/python/torch_grpo.py"), "train.steps=14", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == 14 and s["ranks"] == 2 and s["weight_format"] == "fp8"
    assert s["final_reward"] > s["baseline_reward"] + 0.1, s["rewards"]
