"""Real vLLM behind Troupe, weights over Troupe's own transport: the `troupe` weight-transfer
engine (troupe/vllm_transfer.py, a vLLM plugin of this package) against vLLM's own disk reload,
and SkyRL's and slime's calls (examples/python/{skyrl,slime}_style.py, unchanged) against a
gateway in front of real vLLM servers. Needs the vLLM venv (`vllm_py`); at most two servers
at a time."""

import json
import subprocess

from conftest import ROOT


def make_model(py, out, seed):
    subprocess.run(
        [str(py), str(ROOT / "scripts/make-tiny-model.py"), str(out), "--seed", str(seed)],
        check=True,
        capture_output=True,
        timeout=300,
    )


def test_tensor_updates_match_disk_loads_on_real_vllm(vllm_py):
    """scripts/bench-vllm-weights.py: the same weights through Troupe's transport and through
    vLLM's reload give the same greedy tokens, and two weight sets give different ones."""
    p = subprocess.run(
        [str(vllm_py), str(ROOT / "scripts/bench-vllm-weights.py"), "--sizes", "tiny", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.startswith("vllm_weights."))
    assert lines["vllm_weights.tiny.tokens_match"] == "1", p.stdout
    assert lines["vllm_weights.tiny.weight_sets_differ"] == "1", p.stdout
    assert float(lines["vllm_weights.tiny.tensor.seconds"]) > 0, p.stdout


def config(py, model):
    return "\n".join(
        [
            'allocation_mode: "vllm:d2t1"',
            "cluster: {n_nodes: 1, n_gpus_per_node: 2}",
            f"sglang: {{model_path: {json.dumps(str(model))}, ready_timeout_s: 600}}",
            "vllm:",
            f"  python: {json.dumps(str(py))}",
            "  device: cpu",
            "  enforce_eager: true",
            "  kv_cache_memory_bytes: 268435456",
            "  max_model_len: 1024",
            "gateway: {listen: 127.0.0.1:0, policy: round_robin}",
            "admin_key: k",
            "",
        ]
    )


def test_skyrl_and_slime_calls_reach_real_vllm(vllm_py, tmp_path):
    """Two real vLLM servers behind the gateway: slime's SGLang-named calls, then SkyRL's
    vLLM-named ones, each pushing a safetensors file through `/update_weights_from_tensor`;
    each example checks that generation changed and every engine reports its version."""
    import troupe

    model, other = tmp_path / "seed0", tmp_path / "seed1"
    make_model(vllm_py, model, 0)
    make_model(vllm_py, other, 1)
    cfg_path = tmp_path / "vllm.yaml"
    cfg_path.write_text(config(vllm_py, model))
    cfg = troupe.load_config(str(cfg_path), [])
    weights = [str(other / "model.safetensors"), str(model / "model.safetensors")]
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        for script, version, w in (("slime_style.py", "s1", weights[0]), ("skyrl_style.py", "k2", weights[1])):
            p = subprocess.run(
                [
                    str(vllm_py),
                    str(ROOT / "examples/python" / script),
                    "--gateway",
                    svc.gateway_url,
                    "--admin-key",
                    "k",
                    "--weights",
                    w,
                    "--version",
                    version,
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert p.returncode == 0, f"{script}:\n{p.stdout}{p.stderr}"
            assert "ok: generation changed" in p.stdout, p.stdout
