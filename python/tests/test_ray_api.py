"""A deployment started from inside a Ray driver (a verl- or SkyRL-style script that already
called `ray.init`): `troupe.ray_launcher.config_overrides()` puts its hosts on the driver's own
cluster. Needs the local Ray cluster (`bash scripts/ray-local.sh start --nodes 3`); skipped
without one unless TROUPE_REQUIRE_RAY=1 (CI sets it once its cluster is up).

The suite's venv has Troupe but not Ray: the driver runs with this interpreter and the Ray
venv's packages on its path (both are this machine's python3)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STATE = pathlib.Path(os.environ.get("TROUPE_RAY_DIR") or "/tmp/troupe-ray")

DRIVER = r"""
import json, sys, urllib.request
import ray, troupe
from troupe.ray_launcher import config_overrides

address, config, ray_python = sys.argv[1:4]
ray.init(address=address, namespace="troupe-driver-test", log_to_driver=False, logging_level="ERROR")
overrides = config_overrides(python=ray_python)
cfg = troupe.load_config(config, overrides + ["cluster.n_gpus_per_node=2", "admin_key=k"])
with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
    body = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).encode()
    req = urllib.request.Request(svc.gateway_url + "/generate", body, {"content-type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
    print(json.dumps({"overrides": overrides, "tokens": answer["meta_info"]["completion_tokens"]}))
"""


def ray_cluster():
    try:
        address = (STATE / "address").read_text().strip()
        python = (STATE / "python").read_text().strip()
    except OSError as e:
        return None, f"no local Ray cluster in {STATE}: {e}"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if site.returncode != 0:
        return None, f"{python}: {site.stderr.strip()}"
    return (address, python, site.stdout.strip()), ""


@pytest.fixture(scope="module")
def ray_env():
    found, why = ray_cluster()
    if found is None:
        if os.environ.get("TROUPE_REQUIRE_RAY") == "1":
            pytest.fail(f"TROUPE_REQUIRE_RAY=1 but Ray is not usable: {why}")
        pytest.skip(f"SKIP: {why} (bash scripts/ray-local.sh install && bash scripts/ray-local.sh start --nodes 3)")
    return found


def test_a_ray_driver_starts_a_deployment_on_its_own_cluster(ray_env):
    address, ray_python, site = ray_env
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, address, str(ROOT / "examples/configs/pd-ray.yaml"), ray_python],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4
    assert "scheduler.type=ray" in result["overrides"]
    assert f"scheduler.address={address}" in result["overrides"]
    assert "scheduler.namespace=troupe-driver-test" in result["overrides"]
