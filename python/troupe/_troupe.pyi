"""Type stubs of Troupe's Python bindings."""

import os
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol, Sequence, final

from typing_extensions import Self

import numpy as np
import numpy.typing as npt

# What `from troupe._troupe import *` gives, as the extension sets it.
__all__ = [
    "Config",
    "load_config",
    "Cluster",
    "Service",
    "TroupeError",
    "ConfigError",
    "AllocationError",
    "ClusterError",
    "ServingError",
    "WeightSyncError",
    "ControlError",
    "RolloutError",
    "ActorError",
    "HostLostError",
    "RemoteError",
    "ActorDiedError",
    "Events",
    "Trainer",
    "InferenceClient",
    "Control",
    "Trajectory",
    "pad_batch",
    "Host",
    "ActorRef",
    "Group",
    "RolloutController",
    "ControllerClient",
    "TcpWeightSender",
    "SenderBases",
    "ReceiverBases",
    "TcpWeightReceiver",
    "LetterTask",
    "Prompts",
    "grpo_advantages",
    "cli_main",
    "set_binary",
]

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

class ActorError(TroupeError):
    """A call to an actor failed: it died, stopped, timed out, or its handler returned an error."""

class HostLostError(ActorError):
    """The host an actor lives on is gone."""

class RemoteError(ActorError):
    """A Python actor's method raised; the actor keeps running."""
    kind: str
    remote_message: str
    remote_traceback: str
    rank: int
    """Set when the call was a group call: the rank that raised."""

class ActorDiedError(ActorError):
    """A Python actor's worker process died during the call."""
    rank: int

class RolloutError(TroupeError):
    """Rollouts cannot deliver: nothing left running could complete the batch."""

@final
class Config:
    """A loaded, checked config (`troupe serve`'s YAML)."""
    @property
    def allocation_mode(self) -> str: ...
    @property
    def n_nodes(self) -> int: ...
    @property
    def n_gpus_per_node(self) -> int: ...
    @property
    def model_path(self) -> str: ...
    @property
    def weight_format(self) -> str:
        """`fp8` (block-quantized to the engines) or `bf16`."""
    @property
    def weights_delta(self) -> str:
        """`weights.delta`: `auto` (only what changed travels), `off` or `compress`."""
    @property
    def train(self) -> dict[str, Any]:
        """`train.*` with defaults filled in."""
    @property
    def rollout(self) -> dict[str, Any]:
        """`rollout.*` with defaults filled in (AReaL's names)."""

def load_config(path: str, overrides: Sequence[str] = ...) -> Config:
    """Loads a YAML config with `dotted.key=value` overrides; ConfigError names a bad key."""

@final
class InferenceClient:
    """Generation through a gateway; aborted requests are resubmitted with their tokens so far."""
    def __new__(cls, url: str) -> Self: ...
    @property
    def url(self) -> str: ...
    def generate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """{output_ids, logprobs (float32 arrays), versions, finish_reason, resubmits}; sampling as keywords or SGLang's sampling_params dict."""
    def agenerate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> Awaitable[dict[str, Any]]:
        """`generate` as an asyncio awaitable run on the Rust runtime; cancelling it cancels the request."""

WeightArray = Any
"""numpy float32 / float64 / float16 / bfloat16 (ml_dtypes) / uint16 (bf16 bits), or anything
with `__dlpack__` on the CPU (torch tensors, bf16 included)."""

@final
class Control:
    """A deployment's fleet control plane: one answer for every engine."""
    def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict[str, Any]:
        """Pauses every engine (abort | in_place | retract); none stays paused if one fails."""
    def resume(self) -> dict[str, Any]:
        """Resumes every engine; refused while engines hold different weight versions."""
    def is_paused(self) -> bool: ...
    def server_info(self) -> dict[str, Any]:
        """The fleet summary and each engine's /server_info."""
    def weight_version(self) -> str:
        """The one weight version every serving engine reports."""
    def load_weights(self, path: str | os.PathLike[str], version: str | int) -> dict[str, Any]:
        """Every engine loads the checkpoint at `path` (SGLang: /update_weights_from_disk; vLLM: reload_weights) as `version`."""

@final
class Service:
    """A running inference deployment (servers, proxies, gateway, fleet control plane)."""
    @property
    def gateway_url(self) -> str: ...
    @property
    def admin_key(self) -> str | None:
        """The gateway's admin key (configured, or made for this deployment)."""
    @property
    def control(self) -> Control: ...
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
    def update_weights(self, tensors: Mapping[str, WeightArray], version: str | int) -> dict[str, Any]:
        """Sends the tensors to every engine as `version` (BF16 or FP8 blocks per config), read in place where the layout allows."""
    def load_weights(self, path: str | os.PathLike[str], version: str | int) -> dict[str, Any]:
        """`control.load_weights`: every engine loads a checkpoint from disk (the path into real vLLM)."""
    def update_weights_from(self, trainer: Trainer, version: str | int) -> dict[str, Any]:
        """Pushes the trainer actor's weights to every engine without passing them through Python."""
    def add_servers(self, role: str, count: int = 1) -> list[dict[str, Any]]:
        """Add `count` regular, prefill or decode servers; each routed once it holds the fleet's weights."""
    def remove_server(self, url: str, drain_timeout_s: float = 120.0) -> dict[str, Any]:
        """Drain the server at `url` (no new requests; in-flight ones finish), then stop it."""
    def instances(self) -> list[dict[str, Any]]:
        """Every serving instance and its state (starting, routed, held, down, replaced, draining, removed)."""
    def serve_api(self, listen: str = "127.0.0.1:0", token: str | None = None) -> str:
        """Serves the controller's gRPC API (the external-trainer weight sequence) until teardown; returns host:port."""
    def teardown(self) -> None:
        """Stops the gateway, proxies and servers."""
    def __enter__(self) -> "Service": ...
    def __exit__(self, *args: object) -> bool: ...

@final
class Events:
    """A cluster's lifecycle events: dicts with `kind` (host_lost, actor_started, ...)."""
    def __iter__(self) -> "Events": ...
    def __next__(self) -> dict[str, Any]: ...
    def poll(self, timeout: float) -> dict[str, Any] | None:
        """The next event within `timeout` seconds, or None."""

@final
class Trainer:
    """The built-in reference trainer, a remote actor (AReaL-lite's TrainController shape)."""
    def train_batch(
        self, samples: Sequence[Mapping[str, Any] | "Trajectory"], advantages: Sequence[float] | None = None
    ) -> dict[str, Any]:
        """One GRPO step on samples {prompt_ids, output_ids, logprobs, advantage}, or Trajectory objects with `advantages`."""
    def get_weights(self) -> dict[str, npt.NDArray[np.float32]]:
        """The current weights by Hugging Face name."""

@final
class ActorRef:
    """One Python actor: an object in a worker process on a host, owned by a `troupe.python` actor."""
    @property
    def id(self) -> str: ...
    def call(self, method: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """`method(*args, **kwargs)` remotely, awaitable; calls run in the order they were made."""
    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`call`, blocking (GIL released, Ctrl-C interrupts)."""
    def info(self) -> dict[str, Any]:
        """{pid, env (what Troupe set), restarts}."""
    def stop(self, grace: float = 5.0) -> None:
        """Stops the actor and kills its worker's process group; a no-op when already gone."""

@final
class Group:
    """The ranks of an SPMD group."""
    def call(self, method: str, *args: Any, **kwargs: Any) -> Awaitable[list[Any]]:
        """Every rank, results in rank order; the first rank to fail fails the call (its `rank` set)."""
    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...
    @property
    def ranks(self) -> list[ActorRef]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, rank: int, /) -> ActorRef: ...
    def stop(self, grace: float = 5.0) -> None: ...

@final
class Host:
    """One host of a cluster."""
    @property
    def index(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def gpus(self) -> list[int]: ...
    def spawn(
        self,
        cls: type | str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        gpus: Sequence[int] = ...,
        restarts: int = 0,
        pickle: bool = False,
        name: str | None = None,
        python: str | None = None,
        env: Mapping[str, str] = ...,
        start_timeout: float = 120.0,
    ) -> ActorRef:
        """`cls(*args, **kwargs)` in a worker process on this host; import and constructor errors fail the spawn."""

@final
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
    def host(self, i: int) -> Host:
        """Host `i`, to place Python actors on."""
    def spawn_group(
        self,
        cls: type | str,
        n: int | None = None,
        gpus_per_worker: int = 0,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        placement: Service | None = None,
        restarts: int = 0,
        pickle: bool = False,
        python: str | None = None,
        env: Mapping[str, str] = ...,
        start_timeout: float = 120.0,
    ) -> Group:
        """An SPMD group with torchrun's environment per rank; `placement=svc` uses the allocation's training component."""
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

@final
class Trajectory:
    """One sampled sequence; `group` is its episode's index in a batch (one GRPO group)."""
    def __new__(
        cls,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        reward: float = 0.0,
        versions: Sequence[int] | Sequence[str] | None = None,
    ) -> Self: ...
    @property
    def prompt_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def output_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def logprobs(self) -> npt.NDArray[np.float32]: ...
    @property
    def versions(self) -> npt.NDArray[np.int64]: ...
    @property
    def reward(self) -> float: ...
    @property
    def group(self) -> int | None: ...
    def __len__(self) -> int: ...

def pad_batch(trajectories: Sequence[Trajectory | Mapping[str, Any]], pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """input_ids, attention_mask, loss_mask, logprobs, versions [B, L]; rewards, prompt_lens, seq_lens, group [B]."""

class RolloutWorkflow(Protocol):
    """AReaL-lite's workflow: one data item to a list of trajectories (None drops it)."""
    async def arun_episode(self, client: InferenceClient, data: Any) -> list[Trajectory] | None: ...

@final
class RolloutController:
    """Asynchronous rollouts with bounded staleness (AReaL-lite's API), workflows in Python."""
    def __new__(
        cls,
        service: Service | InferenceClient | str,
        batch_size: int,
        max_concurrent: int = 128,
        max_staleness: int = 1,
        stale_policy: str = "regenerate",
    ) -> Self: ...
    def submit(self, data: Any, workflow: RolloutWorkflow, should_accept: Callable[[Any], bool] | None = None) -> None: ...
    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """Raises TimeoutError, or RolloutError when the batch can no longer be completed."""
    def rollout_batch(
        self, data: Iterable[Any], workflow: RolloutWorkflow, should_accept: Callable[[Any], bool] | None = None, timeout: float | None = None
    ) -> list[Trajectory]: ...
    def prepare_batch(
        self, dataloader: Iterable[Any], workflow: RolloutWorkflow, should_accept: Callable[[Any], bool] | None = None, timeout: float | None = None
    ) -> list[Trajectory]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def get_version(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> "RolloutController": ...
    def __exit__(self, *args: object) -> bool: ...

@final
class ControllerClient:
    """A client of the controller's gRPC API: what rank 0 of an external trainer calls while it broadcasts.

    Each call is an operation of the deployment's control plane (the gateway's control endpoints
    are the same plane) and answers {ok, servers: [{url, ok, error}], message, skipped}: `ok` is
    False when some engine failed (the plane has undone what it undoes: no engine stays paused by
    a failed begin, no engine stays in a group some failed to join), `skipped` the engines the
    fleet marks down. Bad arguments and mixed weight versions at the end raise ControlError."""
    def __new__(cls, addr: str, token: str | None = None, timeout: float = 10.0) -> Self: ...
    def get_weight_plan(self) -> dict[str, Any]:
        """{world_size, engines: [{url, rank_offset, gpus}]}; the trainer is rank 0."""
    def init_weight_group(self, master_address: str, master_port: int, group_name: str, backend: str = "nccl", group_secret: str | None = None) -> dict[str, Any]:
        """Engines join rank 0's group; blocks until they did (run it on a thread while rank 0 accepts)."""
    def begin_weight_update(self, pause_mode: str = "abort") -> dict[str, Any]: ...
    def weight_bucket(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        weight_version: str,
        flush_cache: bool = False,
    ) -> dict[str, Any]:
        """Engines receive one bucket; run it on a thread while rank 0 broadcasts it."""
    def end_weight_update(self, buckets: int | None = None) -> dict[str, Any]: ...

@final
class SenderBases:
    """What a delta broadcast's sender last sent (one bf16 copy), kept across groups."""
    def __new__(cls) -> Self: ...
    @property
    def bytes(self) -> int: ...

@final
class ReceiverBases:
    """What an engine received, kept as the bases of the next deltas across groups."""
    def __new__(cls) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def bytes(self) -> int: ...

@final
class TcpWeightSender:
    """Rank 0 of Troupe's TCP weight broadcast (the reference engines' transport)."""
    def __new__(cls, world_size: int, group_name: str, host: str = "0.0.0.0", delta: bool = True, bases: SenderBases | None = None) -> Self: ...
    @property
    def port(self) -> int: ...
    @property
    def secret(self) -> str:
        """The group's secret: every engine's join must prove it (hand it over with the init call)."""
    def accept_all(self, timeout: float = 60.0) -> None: ...
    def send_bucket(self, tensors: Mapping[str, WeightArray]) -> None:
        """Broadcasts one bucket as bf16, in the order given."""
    def take_stats(self) -> dict[str, Any]:
        """What the buckets since the last call sent: full_bytes, sent_bytes, delta_tensors, whole_tensors, repaired_tensors, changed_fraction."""
    def close(self) -> None: ...

@final
class TcpWeightReceiver:
    """An engine's end of Troupe's TCP weight broadcast (what `troupe.vllm_transfer` runs in vLLM)."""
    def __new__(cls, master_address: str, master_port: int, rank: int, n_ranks: int = 1, group_name: str = ..., timeout: float = 300.0, bases: ReceiverBases | None = None, *, secret: str | None = None) -> Self:
        """Joins rank 0's group (`group_name` empty by default: whichever group rank 0 runs); `secret` (required) is rank 0's TcpWeightSender.secret."""
    @property
    def rank(self) -> int: ...
    def recv_bucket(self, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]], timeout: float = 300.0) -> list[tuple[str, str, list[int], npt.NDArray[np.uint8]]]:
        """One bucket, once every engine holds it: (name, dtype name, shape, raw little-endian bytes) per tensor."""
    def close(self) -> None: ...

@final
class LetterTask:
    """`troupe run`'s task: prompts asking for `target`; reward = fraction of the generated bytes equal to it."""
    def __new__(cls, target: str = "a", seed: int = 0, max_new_tokens: int = 16) -> Self: ...
    def prompts(self) -> Prompts:
        """The prompts, endlessly: {input_ids, seed} (RLVRWorkflow data items)."""
    def __call__(self, prompt: Any, completion: Any, prompt_ids: Any, completion_ids: Sequence[int], **data: Any) -> float: ...

@final
class Prompts:
    """An endless iterator of a task's prompts (`LetterTask.prompts()`)."""
    def __iter__(self) -> Prompts: ...
    def __next__(self) -> dict[str, Any]: ...

def grpo_advantages(trajectories: Sequence[Trajectory]) -> npt.NDArray[np.float32]:
    """Each reward normalised within its group (Trajectory.group), as troupe run computes them."""

def cli_main(argv: Sequence[str]) -> int:
    """Runs the `troupe` CLI with `argv` (its first item the program's name); its exit status."""

def set_binary(path: str) -> None:
    """Tells the controller where the `troupe` executable is (`TROUPE_BIN` still wins)."""
