"""Real vLLM behind Troupe, weights over Troupe's own transport: the `troupe` weight-transfer
engine (troupe/vllm_transfer.py, a vLLM plugin of this package) against vLLM's own disk reload,
and SkyRL's and slime's calls (examples/python/{skyrl,slime}_style.py, unchanged) against a
gateway in front of real vLLM servers, then the elastic fleet on them (a server removed, one
added caught up through the transport). Needs the vLLM venv (`vllm_py`); at most two servers
at a time."""

import json
import pathlib
import subprocess
import urllib.request

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


def push(gateway, safetensors, version):
    """`POST /update_weights_from_tensor` of a safetensors file through the gateway."""
    req = urllib.request.Request(
        f"{gateway}/update_weights_from_tensor?weight_version={version}",
        data=pathlib.Path(safetensors).read_bytes(),
        headers={"Content-Type": "application/octet-stream", "Authorization": "Bearer k"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200


def completion(url, model):
    """The greedy token ids `url` answers a fixed prompt with."""
    body = {"model": str(model), "prompt": "Say a:", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


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

        # The elastic fleet on real vLLM: weights pushed through Troupe's transport, then one
        # server removed and one added in its slot; the new one is caught up through the
        # transport (the controller keeps the last push) before it is routed, so it answers with
        # the pushed weights, not the ones its model path holds.
        push(svc.gateway_url, weights[0], "k3")
        want = completion(svc.gateway_url, model)
        old = [r for r in svc.instances() if r["state"] == "routed"][0]["server_url"]
        assert svc.remove_server(old, drain_timeout_s=60)["state"] == "removed"
        added = svc.add_servers("regular")
        assert [r["state"] for r in added] == ["routed"], added
        assert completion(added[0].get("worker_url") or added[0]["server_url"], model) == want
        assert len([r for r in svc.instances() if r["state"] == "routed"]) == 2
