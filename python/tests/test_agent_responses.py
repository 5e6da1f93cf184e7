"""The Responses API (`POST /v1/responses`) with unchanged client code: the `openai` SDK's
`responses.create` (plain and streamed) and the OpenAI Agents SDK's default model
(`OpenAIResponsesModel`) with a function tool, against `troupe gateway --tokenizer reference`,
recorded into a session."""

import asyncio

import openai
import pytest
from conftest import agent_gateway, open_session, post_json

ADMIN = "responses-test-admin"
CALC = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
}


def _http(url, body=None, key=ADMIN):
    return post_json(url, body, key)


@pytest.fixture(scope="module")
def gateway():
    with agent_gateway(ADMIN) as url:
        yield url


def _session(base):
    return open_session(base, ADMIN)


def test_responses_create_plain_streamed_and_continued(gateway):
    sid, key = _session(gateway)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key)
    r = client.responses.create(model="tiny", input="What is 2+3?", max_output_tokens=4, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and isinstance(r.output_text, str)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens == r.usage.input_tokens + 4
    # Streamed with a forced function call: the event sequence ends in response.completed.
    forced = {"type": "function", "name": "calculator"}
    events = list(
        client.responses.create(
            model="tiny", input="What is 2+3?", tools=[CALC], tool_choice=forced,
            max_output_tokens=6, temperature=0, stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert "response.function_call_arguments.done" in kinds, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed", kinds
    call = next(i for i in done.response.output if i.type == "function_call")
    assert call.name == "calculator"
    # The SDK's stream helper assembles the same response.
    with client.responses.stream(
        model="tiny", input="What is 2+3?", tools=[CALC], tool_choice=forced, max_output_tokens=6, temperature=0
    ) as s:
        final = s.get_final_response()
    assert [i.type for i in final.output] == [i.type for i in done.response.output]
    # Continued from the recorded response, with the tool's result.
    r3 = client.responses.create(
        model="tiny", previous_response_id=done.response.id, tools=[CALC], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        max_output_tokens=3, temperature=0,
    )
    assert r3.previous_response_id == done.response.id
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", previous_response_id="resp_unknown", input="and?")
    turns = _http(f"{gateway}/sessions/{sid}/finish", key=key)["turns"]
    assert [t["id"] for t in turns] == [r.id, done.response.id, final.id, r3.id]
    head = turns[1]["prompt_ids"] + turns[1]["output_ids"]
    assert turns[3]["prompt_ids"][: len(head)] == head, "the continued turn extends its response's tokens"


def test_the_agents_sdks_default_responses_model_calls_a_function_tool(gateway):
    agents = pytest.importorskip("agents")
    sid, key = _session(gateway)
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def calculator(input: str) -> str:
        """Evaluates an arithmetic expression."""
        seen.append(input)
        return "5"

    model = agents.OpenAIResponsesModel(
        model="tiny", openai_client=openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key)
    )
    agent = agents.Agent(
        name="calc",
        instructions="Use the calculator.",
        model=model,
        tools=[calculator],
        model_settings=agents.ModelSettings(tool_choice="calculator", max_tokens=8, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, "What is 2+3?"))
    assert result.final_output == "5"
    assert len(seen) == 1
    turns = _http(f"{gateway}/sessions/{sid}/finish", key=key)["turns"]
    assert len(turns) == 1
    assert turns[0]["messages"][0] == {"role": "system", "content": "Use the calculator."}
