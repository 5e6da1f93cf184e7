"""Python actors: classes in worker processes on the cluster's hosts, under the hosts'
supervision; SPMD groups with torchrun's environment."""

import asyncio
import os
import signal
import time

import ml_dtypes
import numpy as np
import pytest

import troupe
from conftest import need_torch
from workers import Broken, Counter, Keeper, Opaque


def until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except troupe.ActorError:
            pass
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def cluster():
    with troupe.Cluster.in_process(2, 2) as c:
        yield c


@pytest.fixture(scope="module")
def subprocess_cluster():
    with troupe.Cluster.local_processes(1, 1) as c:
        yield c


@pytest.mark.parametrize("which", ["cluster", "subprocess_cluster"])
def test_spawn_call_and_stop(request, which):
    c = request.getfixturevalue(which)
    a = c.host(0).spawn(Counter, (10,), {"step": 2}, gpus=[0])
    assert [a.call_sync("incr") for _ in range(3)] == [12, 14, 16]
    assert a.call_sync("echo", 1, "two", k=[3]) == {"args": [1, "two"], "kwargs": {"k": [3]}}
    assert a.call_sync("env")["CUDA_VISIBLE_DEVICES"] == "0"
    pid = a.info()["pid"]
    assert alive(pid)
    a.stop()
    until(lambda: not alive(pid))
    with pytest.raises(troupe.ActorError):
        a.call_sync("incr")


def test_arguments_travel_bit_exact(cluster):
    a = cluster.host(1).spawn(Keeper)
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(3, 5)).astype(np.float32),
        np.array([np.nan, -0.0, np.inf, 1e-45], np.float32),
        rng.integers(-(2**62), 2**62, size=7),
        rng.normal(size=4).astype(ml_dtypes.bfloat16),
        rng.normal(size=(2, 2)).astype(">f8"),
        np.asfortranarray(rng.normal(size=(4, 3))),
        np.array([True, False]),
        np.zeros((0, 3), np.float16),
    ]
    for x in arrays:
        y = a.call_sync("keep", x)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert np.ascontiguousarray(y).tobytes() == np.ascontiguousarray(x).tobytes()
        assert y.flags.writeable
    nested = {"a": [1, 2.5, None, True, "s", b"\x00\xff"], "n": {"x": np.arange(3)}}
    out = a.call_sync("keep", nested)
    assert out["a"] == nested["a"] and out["n"]["x"].tolist() == [0, 1, 2]


def test_pickle_is_an_explicit_opt_in(cluster):
    plain = cluster.host(0).spawn(Keeper)
    with pytest.raises(TypeError, match="pickle=True"):
        plain.call_sync("keep", Opaque(3))
    pickled = cluster.host(0).spawn(Keeper, pickle=True)
    assert pickled.call_sync("keep", Opaque(3)) == Opaque(3)


def test_an_exception_reaches_the_caller_with_its_traceback_and_the_actor_stays(cluster):
    a = cluster.host(0).spawn(Counter)
    with pytest.raises(troupe.RemoteError, match="bad input") as e:
        a.call_sync("fail", "bad input")
    assert e.value.kind == "ValueError" and e.value.remote_message == "bad input"
    assert "in fail" in e.value.remote_traceback and "workers.py" in e.value.remote_traceback
    assert a.call_sync("incr") == 1
    with pytest.raises(troupe.RemoteError, match="AttributeError"):
        a.call_sync("no_such_method")
    with pytest.raises(troupe.RemoteError, match="dunder"):
        a.call_sync("__init__")


def test_calls_are_ordered_and_awaitable(cluster):
    a = cluster.host(0).spawn(Counter)

    async def main():
        lens = await asyncio.gather(*(a.call("append", i) for i in range(50)))
        assert sorted(lens) == list(range(1, 51))
        assert await a.call("sleep", 0.01) == 0.01

    asyncio.run(main())
    assert a.call_sync("items") == list(range(50))


def test_a_worker_that_dies_fails_its_call_at_once_and_is_restarted(cluster):
    a = cluster.host(1).spawn(Counter, restarts=1)
    first = a.call_sync("pid")
    with pytest.raises(troupe.ActorDiedError, match="exit status: 3"):
        a.call_sync("exit", 3)
    until(lambda: a.call_sync("pid") != first)
    assert a.info()["restarts"] == 1
    # Killed again with no restarts left: the actor stops, and calls fail instead of hanging.
    os.kill(a.call_sync("pid"), signal.SIGKILL)

    def gone():
        try:
            a.call_sync("pid")
            return False
        except troupe.ActorError:
            return True

    deadline = time.monotonic() + 30
    while not gone():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    a.stop()  # already gone: a no-op


def test_a_worker_killed_between_calls_is_restarted(cluster):
    a = cluster.host(0).spawn(Counter, (5,), restarts=2)
    pid = a.call_sync("pid")
    os.kill(pid, signal.SIGKILL)
    until(lambda: a.info()["restarts"] == 1)
    assert a.call_sync("incr") == 6  # a fresh object from the same constructor arguments
    assert a.call_sync("pid") != pid


def test_stopping_kills_the_workers_whole_process_group(cluster):
    a = cluster.host(0).spawn(Counter)
    worker, grandchild = a.call_sync("pid"), a.call_sync("spawn_child")
    assert alive(grandchild)
    a.stop(grace=1.0)
    until(lambda: not alive(worker) and not alive(grandchild))


def test_import_and_constructor_errors_fail_the_spawn(cluster):
    with pytest.raises(troupe.ClusterError, match="No module named 'no_such_module'"):
        cluster.host(0).spawn("no_such_module:Thing")
    with pytest.raises(troupe.ClusterError, match="cannot build this one"):
        cluster.host(0).spawn(Broken)
    with pytest.raises(troupe.ClusterError, match="no_such_python"):
        cluster.host(0).spawn(Counter, python="/no_such_python")
    with pytest.raises(ValueError, match="import path"):
        cluster.host(0).spawn("not a path")
    with pytest.raises(troupe.ClusterError, match="no host 9"):
        cluster.host(9)

    def local():
        class Inner:
            pass

        return Inner

    with pytest.raises(ValueError, match="module level"):
        cluster.host(0).spawn(local())


def test_an_spmd_group_gets_torchruns_environment_and_gathers(cluster):
    g = cluster.spawn_group(Counter, 4, gpus_per_worker=1, args=(100,))
    envs = g.call_sync("env")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert g.call_sync("incr") == [101] * 4
    assert len(g) == 4 and isinstance(g[0], troupe.ActorRef)

    async def main():
        return await g.call("sleep", 0.01)

    assert asyncio.run(main()) == [0.01] * 4
    g.stop()
    with pytest.raises(troupe.ClusterError, match="do not fit"):
        cluster.spawn_group(Counter, 5, gpus_per_worker=1)


def test_a_rank_dying_mid_call_fails_the_group_call_at_once_naming_it(cluster):
    g = cluster.spawn_group(Counter, 3)
    with pytest.raises(troupe.ActorDiedError, match="rank 1") as e:
        g.call_sync("rank_exits_or_sleeps", 1)
    assert e.value.rank == 1
    g.stop(grace=0.5)


def test_a_failing_rank_fails_the_group_spawn_and_stops_the_others(cluster):
    with pytest.raises(troupe.ClusterError, match="cannot build this one"):
        cluster.spawn_group(Broken, 2)


def test_gloo_all_reduce_across_a_group(cluster):
    need_torch()
    g = cluster.spawn_group(Counter, 2)
    assert g.call_sync("allreduce") == [3.0, 3.0]
    g.stop()


def test_a_group_goes_where_the_allocation_put_the_training_component(tmp_path):
    p = tmp_path / "pd-train.yaml"
    p.write_text(
        "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)+fsdp:d2'\n"
        "cluster: {n_nodes: 1, n_gpus_per_node: 4}\n"
        "scheduler: {type: inprocess}\n"
        "sglang: {model_path: tiny, ready_timeout_s: 60}\n"
    )
    cfg = troupe.load_config(str(p))
    with troupe.Cluster.from_config(cfg) as c, c.serve(cfg) as svc:
        g = c.spawn_group(Counter, placement=svc)
        envs = g.call_sync("env")
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]  # after the servers' GPUs
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["MASTER_ADDR"] == "127.0.0.1"
        with pytest.raises(ValueError, match="leave n out"):
            c.spawn_group(Counter, 3, placement=svc)
        g.stop()
    cfg = troupe.load_config(str(p), ["allocation_mode=troupe:(prefill:d1t1|decode:d1t1)"])
    with troupe.Cluster.from_config(cfg) as c, c.serve(cfg) as svc:
        with pytest.raises(troupe.AllocationError, match="no training component"):
            c.spawn_group(Counter, placement=svc)


def test_workers_run_on_the_configured_interpreter(tmp_path):
    import stat
    import sys

    marker = tmp_path / "used"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\ntouch {marker}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    p = tmp_path / "c.yaml"
    p.write_text(
        "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)'\n"
        "cluster: {n_nodes: 1, n_gpus_per_node: 2}\n"
        "scheduler: {type: inprocess}\n"
        f"python: {{executable: {wrapper}}}\n"
    )
    cfg = troupe.load_config(str(p))
    with troupe.Cluster.from_config(cfg) as c:
        a = c.host(0).spawn(Counter)
        assert a.call_sync("incr") == 1 and marker.exists()
    with pytest.raises(troupe.ConfigError, match="executabel"):
        troupe.load_config(str(p), ["python.executabel=/usr/bin/python3"])
