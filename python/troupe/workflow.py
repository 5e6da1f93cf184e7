"""Built-in rollout workflows (AReaL-lite's `RolloutWorkflow` shape: any object with
`async def arun_episode(self, client, data)` returning a list of `troupe.Trajectory`, or None to
drop the item)."""

import asyncio
import importlib
import inspect
from typing import Any, Callable, Mapping, Optional, Union

from ._support import lookup, split_target
from ._troupe import InferenceClient, Trajectory

_SAMPLING = ("max_new_tokens", "temperature", "top_p", "stop_token_ids", "ignore_eos", "greedy", "n_samples")


def _import(path: str) -> Any:
    """`pkg.module:function` or `pkg.module.function`."""
    try:
        mod, name = split_target(path, dotted=True)
    except ValueError as e:
        raise ValueError(f"reward_fn: {e}; give a callable or an import path like 'mypkg.rewards:gsm8k'") from e
    return lookup(importlib.import_module(mod), name)


def _sampling(gconfig: Any) -> dict[str, Any]:
    """Sampling settings from a dict or an object with AReaL's GenerationHyperparameters names."""
    if gconfig is None:
        return {}
    if isinstance(gconfig, dict):
        unknown = sorted(set(gconfig) - set(_SAMPLING))
        if unknown:
            raise ValueError(f"gconfig: unknown keys {unknown}; known: {list(_SAMPLING)}")
        g: dict[str, Any] = dict(gconfig)
    else:
        g = {k: getattr(gconfig, k) for k in _SAMPLING if getattr(gconfig, k, None) is not None}
    if g.pop("greedy", False):
        g["temperature"] = 0.0
    return g


class RLVRWorkflow:
    """Reinforcement learning with verifiable rewards: `n_samples` independent samples of each
    prompt (one GRPO group), each scored by `reward_fn`.

    `reward_fn(prompt, completion, prompt_ids, completion_ids, **data)` is AReaL's signature
    (`prompt` and `completion` are strings when a `tokenizer` is given, else None); it may be a
    coroutine function, or an import path string. A plain function runs on a worker thread so a
    slow reward does not stall other episodes. `gconfig` is a dict or an object with AReaL's
    `GenerationHyperparameters` names (max_new_tokens, temperature, top_p, stop_token_ids,
    greedy, n_samples). A data item gives its prompt as `input_ids` (or `prompt_ids`) token ids,
    or as chat `messages` with a `tokenizer`; an optional `seed` makes its samples reproducible.
    """

    def __init__(
        self,
        reward_fn: Union[Callable[..., Any], str],
        n_samples: Optional[int] = None,
        gconfig: Any = None,
        tokenizer: Any = None,
    ) -> None:
        self.reward_fn: Callable[..., Any] = _import(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if not callable(self.reward_fn):
            raise TypeError("reward_fn must be callable (or an import path string)")
        self.sampling = _sampling(gconfig)
        from_gconfig = self.sampling.pop("n_samples", None)
        n = n_samples if n_samples is not None else from_gconfig
        self.n_samples = 1 if n is None else int(n)
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {self.n_samples}")
        self.tokenizer = tokenizer

    def _prompt_ids(self, data: Mapping[str, Any]) -> list[int]:
        for key in ("input_ids", "prompt_ids"):
            if key in data:
                return [int(t) for t in data[key]]
        if "messages" in data and self.tokenizer is not None:
            return list(self.tokenizer.apply_chat_template(data["messages"], tokenize=True, add_generation_prompt=True))
        raise ValueError("a data item needs input_ids (token ids), or messages and a tokenizer")

    async def _reward(self, prompt_ids: list[int], output_ids: list[int], data: Mapping[str, Any]) -> float:
        decode: Callable[[list[int]], Any] = self.tokenizer.decode if self.tokenizer is not None else (lambda _ids: None)
        args = (decode(prompt_ids), decode(output_ids), prompt_ids, output_ids)
        extra = {k: v for k, v in data.items() if k not in ("input_ids", "prompt_ids")}
        if inspect.iscoroutinefunction(self.reward_fn):
            r = await self.reward_fn(*args, **extra)
        else:
            r = await asyncio.get_running_loop().run_in_executor(None, lambda: self.reward_fn(*args, **extra))
        return float(r)

    async def arun_episode(self, client: InferenceClient, data: Mapping[str, Any]) -> list[Trajectory]:
        prompt_ids = self._prompt_ids(data)
        seed = data.get("seed") if isinstance(data, dict) else None

        async def one(i: int) -> Trajectory:
            s = None if seed is None else (int(seed) * 1_000_003 + i) % (1 << 64)
            g = await client.agenerate(prompt_ids, seed=s, **self.sampling)
            out = [int(t) for t in g["output_ids"]]
            reward = await self._reward(prompt_ids, out, data)
            return Trajectory(prompt_ids, out, g["logprobs"], reward=reward, versions=g["versions"])

        return list(await asyncio.gather(*(one(i) for i in range(self.n_samples))))
