"""Agents written against an LLM API, trained as they are: `AgentWorkflow` runs a user's
`async def run_agent(base_url, api_key, data) -> reward` (written with the `openai` SDK, or any
client of the gateway's OpenAI or Anthropic routes) in a recorded gateway session per sample,
and turns what the gateway recorded into training trajectories: per turn the exact prompt and
output token ids the engine saw and made, their logprobs and weight versions.

The gateway needs its tokenizer (`gateway.tokenizer: reference` in the serve config, or
`troupe gateway --tokenizer DIR`); each turn is one `troupe.Trajectory` (AReaL's "individual"
export), all turns of one sample carrying its reward, all samples of one data item one GRPO
group.
"""

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any, Awaitable, Callable, Mapping, Optional

from ._troupe import InferenceClient, Trajectory

#: The agent a user writes: talks to `base_url` (an OpenAI base URL, `.../v1`) with `api_key`
#: (the session's key), returns the episode's reward.
RunAgent = Callable[[str, str, Any], Awaitable[float]]


def _post(url: str, key: Optional[str], body: Optional[Mapping[str, Any]] = None, timeout: float = 300.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered {e.code}: {e.read().decode(errors='replace')}") from e


def _version(v: Any) -> int:
    """A weight version as an int ("3" → 3; a name such as "default" → 0)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def trajectories(recorded: Mapping[str, Any], reward: float) -> list[Trajectory]:
    """A finished session (`POST /sessions/{id}/finish`'s answer) as one trajectory per turn."""
    out = []
    for t in recorded["turns"]:
        versions = [_version(v) for v in t["weight_versions"]]
        out.append(Trajectory(t["prompt_ids"], t["output_ids"], t["output_logprobs"], reward=reward, versions=versions))
    return out


class AgentWorkflow:
    """`n_samples` episodes of `run_agent` per data item, each in its own recorded session.

    `admin_key`: the gateway's admin key, when it has one (opening a session needs it). An
    episode whose agent raises is retried never: its session is finished and dropped, and the
    error propagates (the RolloutController reports it)."""

    def __init__(self, run_agent: RunAgent, n_samples: int = 1, admin_key: Optional[str] = None) -> None:
        if not callable(run_agent):
            raise TypeError("run_agent must be an async function (base_url, api_key, data) -> reward")
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        self.run_agent = run_agent
        self.n_samples = int(n_samples)
        self.admin_key = admin_key

    async def _one(self, base: str, data: Any) -> list[Trajectory]:
        s = await asyncio.to_thread(_post, f"{base}/sessions", self.admin_key)
        sid, key = s["session_id"], s["api_key"]
        try:
            reward = float(await self.run_agent(f"{base}/v1", key, data))
        finally:
            recorded = await asyncio.to_thread(_post, f"{base}/sessions/{sid}/finish", key)
        return trajectories(recorded, reward)

    async def arun_episode(self, client: InferenceClient, data: Any) -> list[Trajectory]:
        base = client.url.rstrip("/")
        runs = await asyncio.gather(*(self._one(base, data) for _ in range(self.n_samples)))
        return [t for run in runs for t in run]
