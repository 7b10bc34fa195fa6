"""Tool calling (``tools``, ``tool_choice``): calls that parse and validate whatever the model, streamed in
OpenAI's shape (the name first, then argument fragments), and tool results that go back through the template.

The model is the random-init tiny Llama, whose chat template knows no tools: the fallback format, held by
a grammar when the choice requires a call.
"""

from __future__ import annotations

import json
import random

import pytest
from jsonschema import Draft202012Validator

from serving.api.tool_calls import CallStream, StreamedChoice, ToolPlan, parse_calls
from serving.engine import EngineConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _plan(choice: str = "auto") -> ToolPlan:
    return ToolPlan(tuple(TOOLS), choice)


# ----------------------------------------------------------------------------- reading calls
@pytest.mark.parametrize("text, names", [
    ('[{"name":"get_weather","arguments":{"city":"Oslo","days":2}}]', ["get_weather"]),  # the fallback
    ('{"name": "get_time", "parameters": {"zone": "utc"}}', ["get_time"]),  # Llama 3.1
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call>',
     ["get_time", "get_weather"]),  # Qwen2.5, two calls
    ('[{"name":"launch_missiles","arguments":{}}]', None),  # not a tool of this request: text
    ("It is sunny.", None),
    ('{"name": "get_time"', None),  # cut short: text
])
def test_calls_are_read_in_each_known_format(text, names):
    calls = parse_calls(text, _plan())
    assert (None if calls is None else [c["function"]["name"] for c in calls]) == names
    for call in calls or []:
        assert call["type"] == "function" and call["id"].startswith("call_")
        json.loads(call["function"]["arguments"])
    assert parse_calls(text, _plan("none")) is None


def test_a_streamed_array_of_calls_gives_name_first_then_argument_fragments_however_it_is_cut():
    text = ('[{"name":"get_weather","arguments":{"city":"a \\"}{[ b","days":3}},'
            '{"name":"get_time","arguments":{"zone":"utc"}}]')
    rng = random.Random(0)
    for _ in range(50):
        reader, deltas, i = CallStream(), [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            deltas += reader.feed(text[i:j])
            i = j
        names = [(d["index"], d["function"]["name"]) for d in deltas if "name" in d["function"]]
        assert names == [(0, "get_weather"), (1, "get_time")]
        for index, name in names:
            first = next(k for k, d in enumerate(deltas) if d["index"] == index)
            assert deltas[first]["function"] == {"name": name, "arguments": ""} and deltas[first]["id"]
            arguments = "".join(d["function"]["arguments"] for d in deltas if d["index"] == index)
            assert json.loads(arguments) == (json.loads(text)[index]["arguments"])


def test_auto_streams_text_at_once_and_holds_a_reply_that_starts_like_a_call():
    prose = StreamedChoice(_plan())
    assert prose.feed("Hello", None) == ("Hello", [], None)
    assert prose.feed(" [there]", "stop") == (" [there]", [], "stop")
    call = StreamedChoice(_plan())
    assert call.feed('[{"name":"get_time",', None) == ("", [], None)
    content, deltas, reason = call.feed('"arguments":{"zone":"cet"}}]', "stop")
    assert content == "" and reason == "tool_calls" and deltas[0]["function"]["name"] == "get_time"
    not_a_call = StreamedChoice(_plan())
    assert not_a_call.feed("[1, 2", None) == ("", [], None)
    assert not_a_call.feed("]", "stop") == ("[1, 2]", [], "stop")


# ----------------------------------------------------------------------------- through HTTP
@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The tiny Llama with room for the tool listing (its byte-level vocabulary spends a token per few bytes)."""
    from tests.serving.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-2k"), max_pos=2048)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, long_context_model):
    from tests.serving.test_api_server import running_server

    with running_server(long_context_model, EngineConfig(max_num_seqs=16), request.param) as (base, _):
        yield base


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none")


def _check(call) -> None:
    Draft202012Validator(SCHEMAS[call.function.name]).validate(json.loads(call.function.arguments))


@pytest.mark.parametrize("tool_choice, parallel", [("required", True), ("required", False),
                                                   ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_a_required_call_parses_and_validates_streamed_or_not(server, tool_choice, parallel):
    client = _client(server)
    # room for the most calls the grammar allows (8 when parallel, ~60 byte-level tokens each): a random model may
    # write them all, and a reply cut by max_tokens is text, not calls
    kwargs = dict(model="micro", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                  tool_choice=tool_choice, max_tokens=600, temperature=1.0)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    for seed in range(3):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert 1 <= len(choice.message.tool_calls) <= (8 if parallel is not False and tool_choice == "required"
                                                        else 1)
        for call in choice.message.tool_calls:
            _check(call)
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
        chunks = list(client.chat.completions.create(seed=seed, stream=True, **kwargs))
        calls: dict[int, dict] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                if d.function.name:  # the name comes first, alone, with the call's id
                    assert d.index not in calls and d.id and d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert {i: (c["name"], json.loads(c["arguments"])) for i, c in calls.items()} == {
            i: (call.function.name, json.loads(call.function.arguments))
            for i, call in enumerate(choice.message.tool_calls)}  # the same seed, the same calls


def test_tool_results_go_back_through_the_template(server):
    """A whole round trip as an agent runs it: the call, then the tool's answer, then the model's reply."""
    client = _client(server)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model="micro", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=600, seed=1).choices[0].message
    call = first.tool_calls[0]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 12})}]
    reply = client.chat.completions.create(model="micro", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, seed=1).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools.0.function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
     "messages.0.tool_calls.0.function.name"),
])
def test_a_bad_tool_request_is_a_400_naming_its_part(server, body, param):
    import httpx

    r = httpx.post(server + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ----------------------------------------------------------------------------- what a shadow pair compares
def test_a_shadow_pair_compares_tool_calls_by_name_and_arguments_streamed_or_not():
    import orjson

    from serving.gateway.compare import compare_replies
    from serving.gateway.sse import StreamReading, response_text

    def answer(arguments: str, call_id: str) -> dict:
        return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}}]}

    champion = response_text(answer('{"city":"Oslo","days":2}', "call_a"))
    same = response_text(answer('{"days": 2, "city": "Oslo"}', "call_b"))  # other ids, other key order
    other = response_text(answer('{"city":"Rome","days":2}', "call_c"))
    assert compare_replies(champion, same).agree and not compare_replies(champion, other).agree
    assert response_text({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    events = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                                                  "function": {"name": "get_weather",
                                                                               "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                                  "function": {"arguments": '{"city":"Os'}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                                  "function": {"arguments": 'lo","days":2}'}}]}}]}]
    streamed = StreamReading(events=[orjson.dumps(e) for e in events]).text
    assert compare_replies(champion, streamed).agree and compare_replies(champion, streamed).same_json


def test_a_stream_held_to_tool_calls_is_not_continued_as_free_text():
    from serving.gateway.continuation import continuation
    from serving.gateway.sse import StreamReading

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    assert continuation("/v1/chat/completions", body, StreamReading(prompt_token_ids=[1, 2], token_ids=[3])) is None
    free = {**body, "tool_choice": "auto"}
    assert continuation("/v1/chat/completions", free, StreamReading(prompt_token_ids=[1, 2], token_ids=[3]))
