"""Troupe from Python: the single controller as a Python script, every hot path in Rust.

    import troupe
    cfg = troupe.load_config("examples/configs/grpo-local.yaml", ["train.steps=20"])
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        rollout = troupe.RolloutController(svc, batch_size=4, max_staleness=1)
        workflow = troupe.RLVRWorkflow(reward_fn, n_samples=16, gconfig={"max_new_tokens": 16})
        batch = rollout.prepare_batch(dataloader, workflow)     # list of troupe.Trajectory
        arrays = troupe.pad_batch(batch)                         # padded numpy arrays + masks
        svc.update_weights({"model.norm.weight": weights}, version=1)
        rollout.set_version(1)

See examples/python/grpo.py for the whole GRPO loop.
"""

import os as _os
import sys as _sys

from . import _troupe as _native

# Clusters start `troupe host` / `troupe engine` children: the `troupe` script this wheel
# installed beside the venv's python (or the binary scripts/python-env.sh put there) is the
# one, unless TROUPE_BIN names another. Told to the controller, not written to os.environ.
_bin = _os.path.join(_sys.prefix, "bin", "troupe")
if _os.path.isfile(_bin):
    _native.set_binary(_bin)

from ._troupe import (  # noqa: E402
    ActorDiedError,
    ActorError,
    ActorRef,
    AllocationError,
    Cluster,
    ClusterError,
    Config,
    ConfigError,
    Control,
    ControlError,
    ControllerClient,
    Events,
    Group,
    Host,
    HostLostError,
    InferenceClient,
    LetterTask,
    ReceiverBases,
    RemoteError,
    RolloutController,
    RolloutError,
    SenderBases,
    Service,
    ServingError,
    TcpWeightSender,
    TcpWeightReceiver,
    Trainer,
    Trajectory,
    TroupeError,
    WeightSyncError,
    grpo_advantages,
    load_config,
    pad_batch,
)
from .actors import actor  # noqa: E402
from .agent import AgentWorkflow  # noqa: E402
from .workflow import RLVRWorkflow  # noqa: E402

__all__ = [
    "ActorDiedError",
    "AgentWorkflow",
    "ActorError",
    "ActorRef",
    "AllocationError",
    "Cluster",
    "ClusterError",
    "Config",
    "ConfigError",
    "Control",
    "ControlError",
    "ControllerClient",
    "Events",
    "Group",
    "Host",
    "HostLostError",
    "InferenceClient",
    "LetterTask",
    "RLVRWorkflow",
    "ReceiverBases",
    "RemoteError",
    "RolloutController",
    "RolloutError",
    "SenderBases",
    "Service",
    "ServingError",
    "TcpWeightSender",
    "TcpWeightReceiver",
    "Trainer",
    "Trajectory",
    "TroupeError",
    "WeightSyncError",
    "actor",
    "grpo_advantages",
    "load_config",
    "pad_batch",
]
