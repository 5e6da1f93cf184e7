"""Troupe from Python: the single controller as a Python script, every hot path in Rust.

    import troupe
    cfg = troupe.load_config("examples/configs/pd-local.yaml", ["sglang.model_path=tiny"])
    with troupe.Cluster.from_config(cfg) as cluster:
        with cluster.serve(cfg) as svc:
            print(svc.gateway_url)            # SGLang / OpenAI / vLLM endpoints, fleet control
            svc.pause("abort"); svc.resume()
            svc.update_weights({"model.norm.weight": weights}, version="1")
"""

from ._troupe import (
    AllocationError,
    Cluster,
    ClusterError,
    Config,
    ConfigError,
    ControlError,
    Events,
    Service,
    ServingError,
    Trainer,
    TroupeError,
    WeightSyncError,
    load_config,
)

__all__ = [
    "AllocationError",
    "Cluster",
    "ClusterError",
    "Config",
    "ConfigError",
    "ControlError",
    "Events",
    "Service",
    "ServingError",
    "Trainer",
    "TroupeError",
    "WeightSyncError",
    "load_config",
]
