"""The external-trainer sequence from Python: a rank 0 that broadcasts its own weights (here
with Troupe's TCP chain, NCCL's place on the CPU) while the controller's gRPC API does the
engine side on every engine."""

import ml_dtypes
import numpy as np
import pytest

import troupe
from background import in_thread
from workers import Counter


def test_rank_zero_drives_weight_sync_through_the_controller_api(served):
    cluster, svc = served
    addr = svc.serve_api()
    api = troupe.ControllerClient(addr)
    plan = api.get_weight_plan()
    assert plan["world_size"] == 3 and [e["rank_offset"] for e in plan["engines"]] == [1, 2]

    sender = troupe.TcpWeightSender(plan["world_size"], "ext", host="127.0.0.1")
    joined = in_thread(api.init_weight_group, "127.0.0.1", sender.port, "ext", "tcp", sender.secret)
    sender.accept_all(60)
    j = joined()
    assert j["ok"] and [s["ok"] for s in j["servers"]] == [True, True], j

    trainer = cluster.spawn_trainer(model="tiny", init_seed=5)
    weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in trainer.get_weights().items()}
    begun = api.begin_weight_update()
    assert begun["ok"] and begun["message"] == "paused on 2 engines" and begun["skipped"] == []
    names = list(weights)
    loaded = in_thread(
        api.weight_bucket,
        "ext",
        names,
        ["bfloat16"] * len(names),
        [list(weights[n].shape) for n in names],
        "ext-1",
        True,
    )
    sender.send_bucket(weights)
    assert loaded()["ok"]
    assert api.end_weight_update()["ok"]
    assert svc.weight_version() == "ext-1"

    # The same weights pushed by the controller give the same generation.
    g = svc.client().generate([5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    svc.update_weights({k: v.astype(np.float32) for k, v in weights.items()}, version="same")
    h = svc.client().generate([5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert g["output_ids"].tolist() == h["output_ids"].tolist()
    sender.close()


def test_groups_placed_by_a_deployment_learn_the_api_address(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)+fsdp:d1'\n"
        "cluster: {n_nodes: 1, n_gpus_per_node: 3}\n"
        "scheduler: {type: inprocess}\n"
    )
    cfg = troupe.load_config(str(p))
    with troupe.Cluster.from_config(cfg) as c, c.serve(cfg) as svc:
        addr = svc.serve_api()
        g = c.spawn_group(Counter, placement=svc)
        assert g.call_sync("env_of", "TROUPE_CONTROLLER_API") == [addr]
        g.stop()


def test_bad_api_arguments_are_refused(served):
    _, svc = served
    with pytest.raises(ValueError, match="host:port"):
        svc.serve_api("nowhere")
    with pytest.raises(ValueError, match="token"):
        svc.serve_api("0.0.0.0:0")
    with pytest.raises(troupe.ControlError):
        troupe.ControllerClient("127.0.0.1:1", timeout=2.0)
