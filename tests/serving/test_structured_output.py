"""Constrained decoding (``response_format``): the grammar, not the model, guarantees the JSON.

The model is the random-init tiny Llama: left alone it writes noise, so every reply that parses and validates
does so because the masks allowed nothing else. Schemas come from ``benchmarks/random_schemas.py``.
"""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from benchmarks.random_schemas import random_schemas
from serving.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from serving.engine.structured_output import StructuredOutput


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=32))


def _generate(engine: LLMEngine, specs: list[StructuredOutput], temperature: float, max_tokens: int = 200):
    prompt = engine.tokenizer.encode("Answer in JSON:")
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, structured=spec)
              for i, spec in enumerate(specs)]
    return engine.generate([prompt] * len(specs), params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_finished_reply_parses_and_validates_against_its_random_schema(engine, temperature):
    schemas = random_schemas(60, seed=int(temperature * 10) + 1)
    outputs = _generate(engine, [StructuredOutput.json_schema(s) for s in schemas], temperature)
    finished = [(schema, out) for schema, out in zip(schemas, outputs) if out.finish_reason == "stop"]
    assert len(finished) >= 0.9 * len(schemas), [o.finish_reason for o in outputs]  # the grammar ends replies
    for schema, out in finished:
        Draft202012Validator(schema).validate(json.loads(out.text))


def test_json_object_mode_gives_an_object_and_a_plain_request_beside_it_stays_free(engine):
    prompt = engine.tokenizer.encode("Answer in JSON:")
    constrained, free = engine.generate(
        [prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=120, structured=StructuredOutput("json_object")),
                           SamplingParams(temperature=0.0, max_tokens=24)])
    if constrained.finish_reason == "stop":
        assert isinstance(json.loads(constrained.text), dict)
    else:  # an object with no end before max_tokens: still a prefix of one
        assert constrained.text.startswith("{")
    alone = engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=24)])[0]
    assert free.token_ids == alone.token_ids  # the mask touched only its own row


@pytest.mark.parametrize("schema, where, needle", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "response_format.json_schema.schema.properties.a.not", "Unimplemented"),
    ({"type": "foo"}, "response_format.json_schema.schema", "Invalid type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "response_format.json_schema.schema",
     "does not exist"),
])
def test_a_schema_the_grammar_cannot_use_is_refused_naming_its_part(engine, schema, where, needle):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", engine.tokenizer.encode("x"),
                           SamplingParams(max_tokens=8, structured=StructuredOutput.json_schema(schema)))
    assert str(info.value).startswith(f"{where}:") and needle in str(info.value)
    assert not engine.has_unfinished()


def test_a_reply_cut_midway_is_finished_elsewhere_from_its_tokens(engine):
    """What the gateway does when a constrained stream's replica dies: the prompt plus the tokens so far, with
    ``prefix_tokens`` naming them, and the grammar picks up where the reply stopped."""
    from dataclasses import replace

    from serving.gateway.continuation import continuation
    from serving.gateway.sse import StreamReading

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = StructuredOutput.json_schema(schema)
    prompt = engine.tokenizer.encode("Answer in JSON:")
    head = engine.generate([prompt], [SamplingParams(temperature=1.0, seed=5, max_tokens=4, structured=spec)])[0]
    assert head.finish_reason == "length" and len(head.token_ids) == 4
    body = {"prompt": "Answer in JSON:", "max_tokens": 80, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    resumed = continuation("/v1/completions", body, StreamReading(prompt_token_ids=prompt,
                                                                  token_ids=list(head.token_ids)))
    assert resumed.body["response_format"] == body["response_format"]
    assert resumed.body["response_prefix_tokens"] == 4 and resumed.body["prompt"] == prompt + head.token_ids
    tail = engine.generate([resumed.body["prompt"]], [SamplingParams(
        temperature=1.0, seed=6, max_tokens=76, structured=replace(spec, prefix_tokens=4))])[0]
    assert tail.finish_reason == "stop"
    Draft202012Validator(schema).validate(json.loads(engine.tokenizer.decode(head.token_ids + tail.token_ids,
                                                                             skip_special_tokens=True)))
    with pytest.raises(InvalidRequestError, match="^response_prefix_tokens: the reply so far does not fit"):
        engine.add_request("bad-prefix", engine.tokenizer.encode("no json here"),
                           SamplingParams(max_tokens=4, structured=replace(spec, prefix_tokens=3)))


def test_schemas_compile_once(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    before = engine._grammars().compiles
    _generate(engine, [StructuredOutput.json_schema(schema)] * 4, temperature=1.0, max_tokens=40)
    assert engine._grammars().compiles == before + 1


# ----------------------------------------------------------------------------- through HTTP, as clients send it
@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, tiny_model_dir):
    from tests.serving.test_api_server import running_server

    with running_server(tiny_model_dir, EngineConfig(max_num_seqs=16), request.param) as (base, _):
        yield base


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def test_chat_replies_follow_their_schema_streamed_or_not(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    finished = 0
    for i, schema in enumerate(random_schemas(8, seed=7)):
        kwargs = dict(model="micro", messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=160,
                      temperature=1.0, seed=i, response_format=_json_schema_format(schema))
        if i % 2:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        if reason == "stop":
            finished += 1
            Draft202012Validator(schema).validate(json.loads(text))
    assert finished >= 6


def test_completions_take_json_object_mode(server):
    import httpx

    r = httpx.post(server + "/v1/completions", json={"prompt": "JSON:", "max_tokens": 160, "temperature": 0.7,
                                                     "seed": 3, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].startswith("{")


def _nested_schema_text(levels: int) -> str:
    """An object schema ``levels`` objects deep, written as text (json.dumps itself recurses)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize("levels, needle", [(100, "nests deeper than"), (5000, "malformed JSON")])
def test_a_schema_nested_past_reason_is_a_400_not_a_crash(server, levels, needle):
    """JSON Schema checks recurse a few frames per level: a hostile schema must not reach them (and a body
    deeper than Python's JSON parser reads is refused before)."""
    import httpx

    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "r", "schema": ' + _nested_schema_text(levels) + "}}}")
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    (_json_schema_format({"type": 5}), "response_format.json_schema.schema.type"),
    (_json_schema_format({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}),
     "response_format.json_schema.schema.properties.a.minimum"),
    (_json_schema_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "response_format.json_schema.schema.properties.a.not"),
])
def test_a_bad_response_format_is_a_400_naming_its_part_and_the_server_serves_on(server, response_format, param):
    import httpx

    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 8, "response_format": response_format})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{param}: ") and error["param"] == param, error
    ok = httpx.post(server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_the_openai_clients_parse_helper_gets_its_pydantic_model_back(server):
    """``client.chat.completions.parse(response_format=Model)``: the client sends the model's strict schema and
    reads the reply back into the model, unmodified."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Order(BaseModel):
        item: str = Field(max_length=8)
        quantity: int = Field(ge=1, le=9)
        express: bool

    client = OpenAI(base_url=server + "/v1", api_key="none")
    parsed = 0
    for seed in range(4):
        choice = client.chat.completions.parse(model="micro", messages=[{"role": "user", "content": "Order:"}],
                                               response_format=Order, max_tokens=60, seed=seed).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Order)
            parsed += 1
    assert parsed >= 3


# ----------------------------------------------------------------------------- the shadow's comparison
@pytest.mark.parametrize("primary, shadow, same_json, agree", [
    ('{"a": 1, "b": [true, null]}', '{"b":[true,null],"a":1}', True, True),  # key order, whitespace: not behaviour
    ('{"a": 1}', '{"a": 2}', False, False),
    ('{"a": 1}', '{"a": 1', None, False),  # one side cut by max_tokens
    ("[1, 2]", "[2, 1]", False, False),
    ("Answer: 3", "Answer: 3", None, True),  # plain replies are compared as before
])
def test_a_shadow_pair_of_json_replies_is_compared_as_json(primary, shadow, same_json, agree):
    from serving.gateway.compare import compare_replies

    cmp = compare_replies(primary, shadow)
    assert (cmp.same_json, cmp.agree) == (same_json, agree)


def test_response_format_passes_through_the_gateway_and_its_shadow(tmp_path, tiny_model_dir):
    """Through the gateway, with every request mirrored to a shadow of the same weights: the user gets valid
    JSON, streamed or not, and the shadow's greedy JSON replies are counted as agreeing."""
    import time

    import httpx

    from tests.serving.fleet_support import bearer, engine_thread
    from tests.serving.test_gateway import MODEL, gateway, window

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
            "temperature": 0, "response_format": _json_schema_format(schema)}
    with engine_thread(tiny_model_dir, "tiny-a") as replica, engine_thread(tiny_model_dir, "tiny-b") as twin, \
            gateway(tmp_path, [replica], shadow=[twin], shadow_fraction=1.0) as (base, user, admin, _):
        since = time.time() - 1
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=bearer(user), timeout=60)
        assert reply.status_code == 200, reply.text
        Draft202012Validator(schema).validate(json.loads(reply.json()["choices"][0]["message"]["content"]))
        streamed = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, headers=bearer(user),
                              timeout=60)
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in streamed.text.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:]).get("choices"))
        Draft202012Validator(schema).validate(json.loads(text))
        deadline = time.time() + 30
        while time.time() < deadline:
            pairs = window(base, admin, since)["pairs"]
            if pairs and pairs[0]["compared"] >= 2:
                break
            time.sleep(0.2)
        assert pairs[0]["compared"] >= 2 and pairs[0]["agree"] == pairs[0]["compared"], pairs
