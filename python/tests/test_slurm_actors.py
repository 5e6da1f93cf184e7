"""Python actors on Slurm hosts: the worker processes run on the allocated nodes with the
configured interpreter. Needs a running Slurm cluster with three idle nodes (`bash
scripts/slurm-local.sh start --nodes 3` as root); skipped without one unless
TROUPE_REQUIRE_SLURM=1 (CI sets it once its cluster is up)."""

import os
import pathlib
import subprocess
import sys

import pytest

import troupe
from workers import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]


def slurm_nodes():
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"sinfo: {e}"
    if out.returncode != 0:
        return 0, out.stderr.strip()
    idle = sum(int(line.split()[0]) for line in out.stdout.splitlines() if line.split()[1:] == ["idle"])
    return idle, f"{idle} idle nodes"


@pytest.fixture(scope="module")
def slurm():
    idle, why = slurm_nodes()
    if idle < 3:
        if os.environ.get("TROUPE_REQUIRE_SLURM") == "1":
            pytest.fail(f"TROUPE_REQUIRE_SLURM=1 but Slurm is not usable: {why}")
        pytest.skip(f"no Slurm cluster with 3 idle nodes: {why}")


def test_python_actors_run_on_slurm_nodes_with_the_configured_interpreter(slurm, tmp_path):
    cfg = troupe.load_config(
        str(ROOT / "examples/configs/pd-slurm.yaml"),
        [f"scheduler.log_dir={tmp_path}/logs", f"python.executable={sys.executable}", "cluster.n_nodes=2"],
    )
    with troupe.Cluster.from_config(cfg) as cluster:
        assert len(cluster.hosts) == 2
        group = cluster.spawn_group(Counter, 2)
        envs = group.call_sync("env")
        assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
        pids = [r.info()["pid"] for r in group.ranks]
        assert all(p > 0 for p in pids) and len(set(pids)) == 2
        assert group.call_sync("incr") == [1, 1]
        group.stop()
