"""An elastic fleet from Python: `Service.add_servers` launches a decode that serves the fleet's
weights, `Service.remove_server` drains one out, and the last decode is never removed."""

import json
import urllib.request

import numpy as np
import pytest

import troupe


def greedy(svc):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    req = urllib.request.Request(
        svc.gateway_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_a_decode_added_and_one_removed_from_python(tmp_path):
    p = tmp_path / "pd.yaml"
    p.write_text(
        "allocation_mode: 'troupe:(prefill:d1t1|decode:d1t1)'\n"
        "cluster: {n_nodes: 1, n_gpus_per_node: 3}\n"
        "scheduler: {type: inprocess}\n"
        "sglang: {model_path: tiny, ready_timeout_s: 60}\n"
        "admin_key: test-key\n"
    )
    cfg = troupe.load_config(str(p))
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        h = 64
        svc.update_weights({"model.norm.weight": np.full(h, 0.5, dtype=np.float32)}, version="py1")
        before = greedy(svc)
        old = [r for r in svc.instances() if r["worker_type"] == "decode"][0]["server_url"]

        added = svc.add_servers("decode")
        assert [r["state"] for r in added] == ["routed"]
        assert len([r for r in svc.instances() if r["state"] == "routed"]) == 3

        removed = svc.remove_server(old, drain_timeout_s=30)
        assert removed["state"] == "removed"
        # Every answer now comes from the added decode, on the fleet's weights.
        for _ in range(3):
            v = greedy(svc)
            assert v["output_ids"] == before["output_ids"]
            assert v["meta_info"]["weight_version"] == "py1"

        with pytest.raises(troupe.ServingError, match="last routed decode"):
            svc.remove_server(added[0]["server_url"])
        with pytest.raises(ValueError, match="role"):
            svc.add_servers("trainer")
