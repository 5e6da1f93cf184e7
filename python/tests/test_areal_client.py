"""AReaL's own client against Troupe's gateway: areal 1.0.4's `OpenAIProxyClient` (what its
`OpenAIProxyWorkflow` runs) opens a session, the agent chats through the OpenAI SDK with the
session's key at AReaL's base URL (no `/v1`), sets its reward, ends the session and exports the
interactions, which AReaL's own deserializer reads into its tensors.

areal installs with torch and its whole training stack, so this runs where it is installed
(`TROUPE_REQUIRE_AREAL=1` makes it required) and is skipped loudly elsewhere."""

import asyncio
import os

import pytest

if os.environ.get("TROUPE_REQUIRE_AREAL") == "1":
    from areal.experimental.openai.proxy.client_session import OpenAIProxyClient
else:
    proxy = pytest.importorskip("areal.experimental.openai.proxy.client_session", reason="areal is not installed")
    OpenAIProxyClient = proxy.OpenAIProxyClient

import aiohttp  # noqa: E402  (areal's own dependency)
import openai  # noqa: E402
from conftest import agent_gateway  # noqa: E402

ADMIN = "areal-test-admin"


@pytest.fixture(scope="module")
def gateway():
    with agent_gateway(ADMIN) as url:
        yield url


def test_areals_proxy_client_records_and_exports_through_the_gateway(gateway):
    async def episode():
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gateway}/grant_capacity", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                assert r.status == 200
            client = OpenAIProxyClient(session=http, base_url=gateway, task_id="7", admin_api_key=ADMIN)
            async with client:
                agent = openai.AsyncOpenAI(base_url=gateway, api_key=client.session_api_key)
                first = await agent.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                second = await agent.chat.completions.create(
                    model="tiny",
                    messages=[
                        {"role": "user", "content": "hi"},
                        first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "more"},
                    ],
                    max_tokens=4,
                )
                await client.set_reward(first.id, 0.25)
                await client.set_last_reward(1.0)
            assert client.session_id == "7-0"
            return first, second, await client.export_interactions(discount=0.5)

    first, second, got = asyncio.run(episode())
    assert list(got) == [first.id, second.id]
    # AReaL's discount: back from the last turn, cur = cur * 0.5 + reward.
    assert got[second.id].reward == pytest.approx(1.0)
    assert got[first.id].reward == pytest.approx(0.25 + 0.5)
    t = got[second.id]._cache
    n = second.usage.prompt_tokens + second.usage.completion_tokens
    assert list(t["input_ids"].shape) == [1, n]
    assert int(t["loss_mask"].sum()) == second.usage.completion_tokens
    head = got[first.id]._cache["input_ids"][0].tolist()
    assert t["input_ids"][0].tolist()[: len(head)] == head, "turn 2 extends turn 1's exact tokens"
