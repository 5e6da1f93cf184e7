"""The bindings over the real controller: configs, clusters, a PD deployment, fleet control and
weight updates from numpy, and the error mapping."""

import json
import urllib.request

import numpy as np
import pytest

import troupe

ROOT_CFG = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples/configs/pd-local.yaml")


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def greedy(svc):
    return post(
        svc.gateway_url + "/generate",
        {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}},
    )["output_ids"]


def test_load_config_reads_the_yaml_and_names_bad_keys():
    cfg = troupe.load_config(ROOT_CFG, ["cluster.n_nodes=1"])
    assert cfg.allocation_mode.startswith("troupe:")
    assert cfg.n_nodes == 1
    with pytest.raises(troupe.ConfigError, match="mem_fraction_static"):
        troupe.load_config(ROOT_CFG, ["sglang.mem_fraction_statik=0.8"])
    with pytest.raises(troupe.ConfigError, match="allocation_mode"):
        troupe.load_config(ROOT_CFG, ["sglang.tp_size=2"])
    with pytest.raises(troupe.ConfigError):
        troupe.load_config("/nonexistent.yaml")
    assert issubclass(troupe.ConfigError, troupe.TroupeError)


def test_an_in_process_cluster_lists_its_hosts_and_shuts_down():
    with troupe.Cluster.in_process(2, 4) as cluster:
        hosts = cluster.hosts
        assert [h["index"] for h in hosts] == [0, 1]
        assert all(len(h["gpus"]) == 4 for h in hosts)
    with pytest.raises(troupe.ClusterError, match="shut down"):
        cluster.hosts


def test_serve_controls_every_engine_and_updates_weights_from_numpy(pd_config):
    cfg = troupe.load_config(pd_config)
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        assert svc.gateway_url.startswith("http://")
        info = svc.server_info()
        assert info["fleet"]["engines"] == 2
        paused = svc.pause("in_place")
        assert len(paused["engines"]) == 2
        assert svc.control.is_paused()
        svc.resume()
        assert not svc.control.is_paused()
        svc.control.pause("abort", clear_cache=True)
        svc.control.resume()
        with pytest.raises(ValueError, match="later"):
            svc.pause("later")

        before = greedy(svc)
        h = 64  # the tiny model's hidden size
        norm = np.random.default_rng(0).normal(size=h).astype(np.float32)
        rep = svc.update_weights({"model.norm.weight": norm}, version="py1")
        assert rep["version"] == "py1" and rep["buckets"] >= 1
        assert svc.weight_version() == "py1"
        assert greedy(svc) != before

        # Bad input raises and changes nothing.
        with pytest.raises(TypeError, match="model.norm.weight"):
            svc.update_weights({"model.norm.weight": np.zeros(h, dtype=np.int32)}, version="bad")
        with pytest.raises(troupe.WeightSyncError):
            svc.update_weights({"model.no_such.weight": np.zeros(h, dtype=np.float32)}, version="bad")
        with pytest.raises(troupe.WeightSyncError):
            svc.update_weights({"model.norm.weight": np.zeros(h + 1, dtype=np.float32)}, version="bad")
        assert svc.weight_version() == "py1"


def test_an_invalid_allocation_is_an_allocation_error(pd_config):
    cfg = troupe.load_config(pd_config, ["allocation_mode=fsdp:d1"])
    with troupe.Cluster.in_process(1, 2) as cluster:
        with pytest.raises(troupe.ServingError, match="no inference component"):
            cluster.serve(cfg)


def test_connect_reaches_running_hosts_and_names_a_wrong_token():
    import os
    import subprocess

    host = subprocess.Popen(
        [os.environ["TROUPE_BIN"], "host", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TROUPE_TOKEN": "py-token"},
    )
    try:
        addr = host.stdout.readline().split()[-1]
        with pytest.raises(troupe.ClusterError):
            troupe.Cluster.connect([addr], token="wrong")
        with troupe.Cluster.connect([addr], token="py-token") as cluster:
            assert len(cluster.hosts) == 1
    finally:
        host.kill()
        host.wait()


def test_events_report_the_servers_a_deployment_starts(pd_config):
    cfg = troupe.load_config(pd_config)
    with troupe.Cluster.from_config(cfg) as cluster:
        events = cluster.events()
        assert events.poll(0.05) is None
        with cluster.serve(cfg):
            want = {"troupe.inference", "troupe.proxy", "troupe.gateway"}
            kinds = set()
            while not want <= kinds and (e := events.poll(10.0)) is not None:
                kinds.add(e.get("actor_kind"))
            assert want <= kinds, kinds
        with pytest.raises(ValueError, match="timeout"):
            events.poll(-1)


def test_ctrl_c_interrupts_a_blocking_call():
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import troupe\n"
        "c = troupe.Cluster.in_process(1, 1)\n"
        "ev = c.events()\n"
        "try:\n"
        "    print('waiting', flush=True)\n"
        "    ev.poll(600)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "c.shutdown()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "waiting"
        # Signal once the main thread sleeps inside the call (GIL released, waiting on Rust).
        import time

        deadline = time.monotonic() + 30
        stat = f"/proc/{p.pid}/task/{p.pid}/stat"
        while open(stat).read().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, "the call never blocked"
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        assert "interrupted" in out and "not interrupted" not in out, out
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_the_reference_trainer_trains_and_its_weights_reach_every_engine(pd_config):
    cfg = troupe.load_config(pd_config)
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        trainer = cluster.spawn_trainer(model="tiny", lr=0.05)
        w0 = trainer.get_weights()
        assert w0["model.norm.weight"].dtype == np.float32
        assert w0["model.norm.weight"].shape == (64,)
        sample = {"prompt_ids": [5, 6, 7], "output_ids": [8, 9, 10], "logprobs": [-1.0, -1.0, -1.0], "advantage": 1.0}
        report = trainer.train_batch([sample, dict(sample, advantage=-1.0)])
        assert report["step"] == 1 and report["tokens"] == 6
        w1 = trainer.get_weights()
        assert any(not np.array_equal(w0[k], w1[k]) for k in w0), "a step changes the weights"
        with pytest.raises(ValueError, match="logprob"):
            trainer.train_batch([dict(sample, logprobs=[-1.0])])
        with pytest.raises(KeyError, match="advantage"):
            trainer.train_batch([{"prompt_ids": [1], "output_ids": [2], "logprobs": [-1.0]}])
        traj = troupe.Trajectory([5, 6, 7], [8, 9, 10], [-1.0, -1.0, -1.0])
        assert trainer.train_batch([traj, traj], advantages=[1.0, -1.0])["step"] == 2
        with pytest.raises(ValueError, match="advantages"):
            trainer.train_batch([traj])
        with pytest.raises(ValueError, match="one advantage per sample"):
            trainer.train_batch([traj], advantages=[1.0, 2.0])
        rep = svc.update_weights(w1, version="trained-1")
        assert rep["version"] == "trained-1"
        assert svc.weight_version() == "trained-1"


def test_the_client_generates_blocking_and_from_asyncio(pd_config):
    import asyncio

    cfg = troupe.load_config(pd_config)
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        client = svc.client()
        assert isinstance(client, troupe.InferenceClient)
        g = client.generate([5, 6, 7], max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(g["output_ids"]) == 4 and g["logprobs"].dtype == np.float32
        assert g["finish_reason"] == "length"

        async def many():
            return await asyncio.gather(
                *(client.agenerate([5, 6, 7], max_new_tokens=4, temperature=0.0, ignore_eos=True) for _ in range(4))
            )

        outs = asyncio.run(many())
        assert all(list(o["output_ids"]) == list(g["output_ids"]) for o in outs)
        with pytest.raises(ValueError, match="input_ids"):
            client.generate([])


def test_actor_call_failures_raise_by_family():
    import os
    import subprocess
    import time

    host = subprocess.Popen([os.environ["TROUPE_BIN"], "host", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        addr = host.stdout.readline().split()[-1]
        with troupe.Cluster.connect([addr]) as cluster:
            trainer = cluster.spawn_trainer()
            bad = {"prompt_ids": [1], "output_ids": [100000], "logprobs": [-1.0], "advantage": 1.0}
            with pytest.raises(troupe.ActorError, match="vocabulary"):
                trainer.train_batch([bad])
            with pytest.raises(troupe.ClusterError, match="no host 3"):
                cluster.spawn_trainer(host=3)
            host.kill()
            host.wait()
            deadline = time.monotonic() + 30
            while True:  # a call racing the loss may fail as a transport error first
                with pytest.raises(troupe.ActorError) as e:
                    trainer.get_weights()
                if isinstance(e.value, troupe.HostLostError):
                    break
                assert time.monotonic() < deadline, "the lost host was never reported"
                time.sleep(0.05)
            assert issubclass(troupe.HostLostError, troupe.ActorError)
    finally:
        host.kill()
        host.wait()
