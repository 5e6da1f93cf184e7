"""Type stubs of Troupe's Python bindings."""

from typing import Any, Mapping, Sequence

import numpy as np
import numpy.typing as npt

class TroupeError(Exception):
    """Every Troupe error."""

class ConfigError(TroupeError):
    """A config file, key or override is wrong."""

class AllocationError(TroupeError):
    """An allocation mode is invalid."""

class ClusterError(TroupeError):
    """Hosts could not be started or reached."""

class ServingError(TroupeError):
    """Servers, proxies or the gateway failed."""

class WeightSyncError(TroupeError):
    """A weight update failed."""

class ControlError(TroupeError):
    """A fleet control call failed on some engine."""

class Config:
    """A loaded, checked config (`troupe serve`'s YAML)."""
    @property
    def allocation_mode(self) -> str: ...
    @property
    def n_nodes(self) -> int: ...
    @property
    def n_gpus_per_node(self) -> int: ...

def load_config(path: str, overrides: Sequence[str] = ...) -> Config:
    """Loads a YAML config with `dotted.key=value` overrides; ConfigError names a bad key."""

class InferenceClient:
    """Generation through a gateway; aborted requests are resubmitted with their tokens so far."""
    def __init__(self, url: str) -> None: ...
    @property
    def url(self) -> str: ...
    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """{output_ids, logprobs (float32 arrays), versions, finish_reason, resubmits}."""
    async def agenerate(self, input_ids: Sequence[int], **sampling: Any) -> dict[str, Any]:
        """`generate`, awaitable from asyncio."""

class Service:
    """A running inference deployment (servers, proxies, gateway, fleet control plane)."""
    @property
    def gateway_url(self) -> str: ...
    def client(self) -> InferenceClient:
        """A generation client for this deployment's gateway."""
    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """Pauses every engine (abort | in_place | retract); none stays paused if one fails."""
    def resume(self) -> dict[str, Any]:
        """Resumes every engine; refused while engines hold different weight versions."""
    def server_info(self) -> dict[str, Any]:
        """The fleet summary and each engine's /server_info."""
    def weight_version(self) -> str:
        """The one weight version every serving engine reports."""
    def update_weights(
        self, tensors: Mapping[str, npt.NDArray[np.float32] | npt.NDArray[np.float64]], version: str
    ) -> dict[str, Any]:
        """Sends the tensors to every engine as `version` (BF16 or FP8 blocks per config)."""
    def teardown(self) -> None:
        """Stops the gateway, proxies and servers."""
    def __enter__(self) -> "Service": ...
    def __exit__(self, *args: object) -> bool: ...

class Events:
    """A cluster's lifecycle events: dicts with `kind` (host_lost, actor_started, ...)."""
    def __iter__(self) -> "Events": ...
    def __next__(self) -> dict[str, Any]: ...
    def poll(self, timeout: float) -> dict[str, Any] | None:
        """The next event within `timeout` seconds, or None."""

class Trainer:
    """The built-in reference trainer, a remote actor (AReaL-lite's TrainController shape)."""
    def train_batch(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One GRPO step on samples {prompt_ids, output_ids, logprobs, advantage}."""
    def get_weights(self) -> dict[str, npt.NDArray[np.float32]]:
        """The current weights by Hugging Face name."""

class Cluster:
    """The actor hosts one controller drives."""
    @staticmethod
    def from_config(cfg: Config) -> "Cluster": ...
    @staticmethod
    def in_process(hosts: int = 1, gpus_per_host: int = 8) -> "Cluster": ...
    @staticmethod
    def local_processes(hosts: int = 1, gpus_per_host: int = 8) -> "Cluster": ...
    @staticmethod
    def connect(addrs: Sequence[str], token: str | None = None) -> "Cluster":
        """Hosts already running at `addrs` (`troupe host --listen ...`)."""
    @property
    def hosts(self) -> list[dict[str, Any]]: ...
    def spawn_trainer(
        self, model: str = "tiny", host: int = 0, lr: float = 0.01, temperature: float = 1.0, init_seed: int = 0
    ) -> Trainer:
        """Starts the reference trainer actor on `host`."""
    def events(self) -> Events:
        """The cluster's lifecycle events from now on."""
    def serve(self, cfg: Config) -> Service:
        """Brings up the config's inference deployment on these hosts."""
    def shutdown(self) -> None:
        """Stops every host. Idempotent."""
    def __enter__(self) -> "Cluster": ...
    def __exit__(self, *args: object) -> bool: ...
