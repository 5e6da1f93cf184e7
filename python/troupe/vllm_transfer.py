"""Troupe's weight transport inside real vLLM: a vLLM weight-transfer engine named ``troupe``.

vLLM's four-phase weight update (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` per bucket, ``/finish_weight_update``) leaves the transport to a pluggable
engine (``vllm/distributed/weight_transfer/base.py``); the engines vLLM ships need CUDA (NCCL,
CUDA IPC, RDMA). This one joins Troupe's TCP broadcast instead (the Rust receiver,
``troupe.TcpWeightReceiver``), so the controller's weight sync, the gateway's
``/update_weights_from_tensor`` and vLLM's own routes reach vLLM workers on a CPU as on a GPU,
in the same bodies Troupe's gateway sends every vLLM-dialect engine:

- ``init_info``: ``master_address``, ``master_port`` (rank 0), ``rank_offset`` (this server's
  first rank), ``world_size``, ``group_secret`` (rank 0's ``TcpWeightSender.secret``: every
  join proves it, since the port is not secret; required); ``packed`` is accepted and changes
  nothing (the TCP sender frames a bucket as one byte stream either way). Each worker of the server joins as its own
  rank, ``rank_offset`` + its global worker rank, as vLLM's NCCL engine numbers them.
- ``update_info``: ``names``, ``dtype_names``, ``shapes`` (``packed`` likewise): one bucket,
  loaded through the model's ``load_weights`` once rank 0 confirms every engine holds it.

vLLM finds the engine through its ``vllm.general_plugins`` entry point (``register`` below,
declared in Troupe's ``pyproject.toml``), which every vLLM process loads at start; a server
uses it with ``--weight-transfer-config '{"backend": "troupe"}'``, which ``troupe serve`` adds
when the server's Python has this package. Nothing here is imported unless vLLM asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from troupe._troupe import ReceiverBases, TcpWeightReceiver

#: The backend name a server selects (``--weight-transfer-config '{"backend": "troupe"}'``).
BACKEND = "troupe"

#: Seconds a join or a bucket may take before the worker gives up (rank 0 sets the pace).
TIMEOUT_S = 600.0


@dataclass
class TroupeInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``: where rank 0 is, which ranks are ours."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    #: The group's secret (rank 0's ``TcpWeightSender.secret``); a join without it is refused.
    group_secret: str = ""

    def __post_init__(self) -> None:
        if not self.group_secret:
            raise ValueError(
                "init_info.group_secret is required: the weight group's secret from rank 0 "
                "(troupe.TcpWeightSender.secret; Troupe's controller sends it), without which "
                "rank 0 admits no worker"
            )
        if not 0 < int(self.master_port) < 65536:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port}")
        if self.rank_offset < 1 or self.world_size <= self.rank_offset:
            raise ValueError(
                f"rank_offset must be at least 1 (rank 0 is the sender) and below world_size; "
                f"got rank_offset {self.rank_offset}, world_size {self.world_size}"
            )


@dataclass
class TroupeUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: one bucket's tensors, in broadcast order."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    packed: bool = False

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                "names, dtype_names and shapes must have one entry per tensor; got "
                f"{len(self.names)}, {len(self.dtype_names)} and {len(self.shapes)}"
            )


def _tensor(raw: Any, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """The received bytes (a numpy uint8 array this call owns) as a tensor, without a copy."""
    dtype = getattr(torch, dtype_name)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


class TroupeWeightTransferEngine(WeightTransferEngine[TroupeInitInfo, TroupeUpdateInfo]):
    """A vLLM worker's end of Troupe's weight broadcast.

    Weights arrive in checkpoint format (Hugging Face names, unsharded), so a session runs
    inside vLLM's layerwise reload, as its NCCL engine's does: quantized and fused layers are
    rebuilt from the new checkpoint tensors exactly as at load.
    """

    init_info_cls = TroupeInitInfo
    update_info_cls = TroupeUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: TcpWeightReceiver | None = None
        self._last: TroupeUpdateInfo | None = None
        # What this worker received, kept as the bases of delta updates across groups: a
        # group re-created after a fleet change still gets deltas if the worker kept them.
        self._bases = ReceiverBases()

    def init_transfer_engine(self, init_info: TroupeInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        self._receiver = TcpWeightReceiver(
            init_info.master_address,
            int(init_info.master_port),
            int(init_info.rank_offset) + worker_rank,
            1,
            "",
            TIMEOUT_S,
            self._bases,
            secret=init_info.group_secret,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            # The copies to the device are asynchronous; the next step must see them.
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TroupeUpdateInfo) -> None:
        if self._receiver is None:
            raise RuntimeError(
                "Troupe weight transfer not initialized: call /init_weight_transfer_engine first"
            )
        if not update_info.names and self._last is not None:
            # Empty lists reuse the previous bucket's metadata, as the reference engine does.
            update_info = self._last
        got = self._receiver.recv_bucket(
            update_info.names, update_info.dtype_names, update_info.shapes, TIMEOUT_S
        )
        self._last = update_info
        weights = [
            (name, _tensor(raw, dtype, shape).to(self.device)) for name, dtype, shape, raw in got
        ]
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        # `nn.Module.__getattr__` is typed as returning a tensor or a module; vLLM models have
        # this method.
        load = cast(Callable[[list[tuple[str, torch.Tensor]]], object], self.model.load_weights)
        with disable_mtp_completeness_check():
            load(weights)

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: makes ``backend: troupe`` available. Loading the
    engine module waits until a server asks for it; a second call changes nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "troupe.vllm_transfer", "TroupeWeightTransferEngine"
        )
    except ValueError:
        pass  # already registered in this process
