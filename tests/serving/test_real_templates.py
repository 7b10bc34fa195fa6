"""Tool calls through the chat templates of released models (tests/serving/templates says where each is from).

Both Granite templates take tools but not OpenAI's history: 3.0 reads earlier calls and tool results under roles
of its own, 3.3 writes every turn's content and nothing else. Given OpenAI's messages as they come, 3.0 drops the
tool's result and both drop the call, so the model would answer as if the tool never ran. The server writes the
history the way each template reads it, and refuses (400) a template that still leaves a tool turn out.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from jsonschema import Draft202012Validator

from serving.api.tool_formats import GRANITE, call_format
from serving.engine import EngineConfig
from tests.serving.test_tool_calls import TOOLS

TEMPLATES = Path(__file__).parent / "templates"
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


def _serve(tmp_path_factory, name: str, template: str):
    from tests.serving.conftest import build_tiny_model
    from tests.serving.test_api_server import running_server

    model = build_tiny_model(tmp_path_factory.mktemp(name), max_pos=2048, specials=("<|tool_call|>",))
    (model / "chat_template.jinja").write_text(template)
    return running_server(model, EngineConfig(max_num_seqs=4))


@pytest.fixture(scope="module", params=["granite-3.0-instruct", "granite-3.3-instruct"])
def granite(request, tmp_path_factory):
    with _serve(tmp_path_factory, request.param, (TEMPLATES / f"{request.param}.jinja").read_text()) as served:
        yield request.param, *served


def _prompt_of(base: str, body: dict) -> str:
    """The prompt the server built for ``body`` (its token ids come back with the first streamed chunk)."""
    ids: list[int] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "return_token_ids": True, "max_tokens": 2}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:]).get("prompt_token_ids", [])
    return ids


def test_a_call_and_its_result_reach_the_model_through_a_released_granite_template(granite):
    name, base, engine = granite
    assert call_format(engine.tokenizer) == GRANITE
    body = {"model": "micro", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "seed": 2}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls", reply
    calls = reply["message"]["tool_calls"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        Draft202012Validator(schemas[call["function"]["name"]]).validate(json.loads(call["function"]["arguments"]))

    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}: 12 C"} for i, c in enumerate(calls)]]
    for tools in (TOOLS, None):  # the follow-up may leave the tools out: the history is written the same way
        prompt = engine.tokenizer.decode(_prompt_of(base, {"model": "micro", "messages": turn, "tools": tools}))
        array = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]
        assert f"<|start_of_role|>assistant<|end_of_role|><|tool_call|>{json.dumps(array)}<|end_of_text|>" in prompt
        result_role = "tool_response" if name == "granite-3.0-instruct" else "tool"
        for i in range(len(calls)):
            assert f"<|start_of_role|>{result_role}<|end_of_role|>result {i}: 12 C<|end_of_text|>" in prompt


def test_a_template_that_leaves_a_tool_turn_out_is_a_400_naming_the_message(tmp_path_factory):
    """A template that takes tools but writes only system, user and assistant turns (and only their text): the
    tool's result, then an earlier call, would never reach the model. The server says so, and goes on serving."""
    template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                "{% if m.role in ('system', 'user', 'assistant') %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    with _serve(tmp_path_factory, "drops-tool-turns", template) as (base, _engine):
        result = [*QUESTION, {"role": "assistant", "content": "get_time, please", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
        refused = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                             json={"model": "micro", "messages": result, "tools": TOOLS, "max_tokens": 2})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "messages.2" and "leaves messages of role `tool` out" in error["message"]

        silent_call = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}]
        refused = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                             json={"model": "micro", "messages": silent_call, "tools": TOOLS, "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.1.tool_calls"

        fine = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": "micro", "messages": QUESTION, "tools": TOOLS, "max_tokens": 2})
        assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_template_that_refuses_a_result_without_its_call_is_not_taken_for_one_that_drops_calls(tmp_path_factory):
    """The server checks that calls reach the prompt by rendering the conversation without them; a template that
    then refuses it (a result with no call before it) reads the calls, and the request is served."""
    template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% set ns = namespace(called=false) %}"
                "{% for m in messages %}{% if m.tool_calls %}{% set ns.called = true %}"
                "<|call|>{{ m.tool_calls[0].function.name }}<|end|>\n"
                "{% elif m.role == 'tool' and not ns.called %}{{ raise_exception('a result needs its call') }}"
                "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    with _serve(tmp_path_factory, "strict-template", template) as (base, _engine):
        served = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                            json={"model": "micro", "messages": turn, "tools": TOOLS, "max_tokens": 2})
        assert served.status_code == 200, served.text
