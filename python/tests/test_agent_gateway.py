"""Unchanged agent code against Troupe's gateway: the official `openai` and `anthropic` SDKs talk
to `troupe gateway --tokenizer reference` in front of a reference engine, call a tool, stream,
and the session's trajectory holds exactly the tokens of each turn."""

import json

import anthropic
import openai
import pytest
from conftest import agent_gateway, open_session, post_json

ADMIN = "agent-test-admin"
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
    },
}


def _http(url, body=None, key=ADMIN):
    return post_json(url, body, key)


@pytest.fixture(scope="module")
def gateway():
    with agent_gateway(ADMIN) as url:
        yield url


def _session(base):
    return open_session(base, ADMIN)


def test_the_openai_sdk_calls_a_tool_and_the_trajectory_is_token_exact(gateway):
    sid, key = _session(gateway)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    forced = {"type": "function", "function": {"name": "calculator"}}
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=[CALC], tool_choice=forced, max_tokens=6, temperature=0
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "calculator"
    json.loads(msg.tool_calls[0].function.arguments)
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"})
    # Streamed, as an agent framework may ask: the same answer in chunks.
    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=[CALC], tool_choice="none", max_tokens=5, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    messages.append({"role": "assistant", "content": text})
    messages.append({"role": "user", "content": "thanks"})
    r3 = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True)
    assert len(r3.choices[0].logprobs.content) == r3.usage.completion_tokens
    t = _http(f"{gateway}/sessions/{sid}/finish", key=key)
    turns = t["turns"]
    assert len(turns) == 3
    for prev, cur in zip(turns, turns[1:]):
        head = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(head)] == head, "each turn extends the last one's tokens"
        assert sum(cur["loss_mask"]) == len(cur["output_ids"])
    assert turns[2]["output_logprobs"] == [c.logprob for c in r3.choices[0].logprobs.content]


def test_the_anthropic_sdk_uses_a_tool_streams_and_counts(gateway):
    sid, key = _session(gateway)
    client = anthropic.Anthropic(base_url=gateway, api_key=key)
    tool = {"name": "calculator", "description": "Evaluates.", "input_schema": CALC["function"]["parameters"]}
    messages = [{"role": "user", "content": "What is 2+3?"}]
    r = client.messages.create(
        model="tiny", max_tokens=6, messages=messages, tools=[tool], tool_choice={"type": "tool", "name": "calculator"}
    )
    assert r.stop_reason == "tool_use"
    use = next(b for b in r.content if b.type == "tool_use")
    assert use.name == "calculator" and isinstance(use.input, dict)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]})
    with client.messages.stream(model="tiny", max_tokens=4, messages=messages, tools=[tool]) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.output_tokens >= 1
    counted = client.messages.count_tokens(model="tiny", messages=messages, tools=[tool])
    assert counted.input_tokens > 0
    t = _http(f"{gateway}/sessions/{sid}/finish", key=key)
    a, b = t["turns"]
    assert b["prompt_ids"][: len(a["prompt_ids"]) + len(a["output_ids"])] == a["prompt_ids"] + a["output_ids"]


def test_bad_requests_raise_the_sdks_own_errors(gateway):
    o = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError):
        o.chat.completions.create(model="big", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        o.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    a = anthropic.Anthropic(base_url=gateway, api_key="none", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="big", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
