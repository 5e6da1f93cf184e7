"""Troupe from Python: the single controller as a Python script, every hot path in Rust.

    import troupe
    cfg = troupe.load_config("examples/configs/pd-local.yaml", ["sglang.model_path=tiny"])
    with troupe.Cluster.from_config(cfg) as cluster:
        with cluster.serve(cfg) as svc:
            print(svc.gateway_url)            # SGLang / OpenAI / vLLM endpoints, fleet control
            svc.pause("abort"); svc.resume()
            svc.update_weights({"model.norm.weight": weights}, version="1")
"""

import asyncio

from ._troupe import InferenceClient as _InferenceClient
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



class InferenceClient(_InferenceClient):
    """Generation through a gateway (the Rust rollout client: aborted requests are resubmitted,
    each token keeps its weight version). `generate` blocks with the GIL released;
    `agenerate` is the same call awaitable from asyncio."""

    async def agenerate(self, input_ids, **sampling):
        """`generate` on a worker thread, awaitable: many run concurrently."""
        return await asyncio.to_thread(self.generate, input_ids, **sampling)


__all__ = [
    "AllocationError",
    "Cluster",
    "ClusterError",
    "Config",
    "ConfigError",
    "ControlError",
    "Events",
    "InferenceClient",
    "Service",
    "ServingError",
    "Trainer",
    "TroupeError",
    "WeightSyncError",
    "load_config",
]
