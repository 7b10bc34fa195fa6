"""A required or named tool choice is held to the format the model's chat template shows it: Llama 3.1's one
``{"name", "parameters"}`` object, Hermes/Qwen2.5's ``<tool_call>`` blocks, Mistral's ``[TOOL_CALLS]`` token and
array, our fallback's array. The calls parse and validate whatever the model (here a random-init tiny Llama with
each template), streamed or not, and go back through the template they came from."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from serving.api.tool_calls import ToolPlan, parse_calls
from serving.api.tool_formats import FALLBACK, GRANITE, HERMES, LLAMA, MISTRAL, PYTHONIC, QWEN_XML, call_format
from serving.api.tool_grammar import call_grammar
from serving.engine import EngineConfig
from tests.serving.conftest import CHAT_TEMPLATE
from tests.serving.test_tool_calls import SCHEMAS, TOOLS

_TURNS = ("{% for m in messages %}<|{{ m['role'] }}|>\n"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
          "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# the parts of Qwen2.5's and Llama 3.1's templates that matter here: how tools are shown, how a call is written
HERMES_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nYou may call functions. Signatures: "
                   "{% for t in tools %}{{ t | tojson }}{% endfor %}\nFor each call, return "
                   '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>\n'
                   "{% endif %}" + _TURNS.replace("CALL", "<tool_call>\n{{ c.function | tojson }}\n</tool_call>"))
LLAMA_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nRespond with a JSON for a function call, in the format "
                  '{"name": function name, "parameters": dictionary of argument name and its value}. '
                  "{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>\n{% endif %}"
                  + _TURNS.replace("CALL", '{"name": "{{ c.function.name }}", "parameters": '
                                           "{{ c.function.arguments | tojson }}}"))

# Mistral's v3 template in brief: tools in [AVAILABLE_TOOLS], calls as the [TOOL_CALLS] control token then a JSON
# array, results in [TOOL_RESULTS]; a call id that is not 9 characters is refused, as the real template does
_NINE = ("{% if ID|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
         "{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}" + _NINE.replace("ID", "m.tool_call_id")
    + '[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}" + _NINE.replace("ID", "c.id")
    + '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>{% elif m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
# Granite 3.x in brief: the tools as an `available_tools` turn, earlier calls as <|tool_call|> and a JSON array
_GRANITE_TURNS = ("{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{% if m.tool_calls %}"
                  '<|tool_call|>[{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
                  "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
                  "{% else %}{{ m['content'] }}{% endif %}<|end_of_text|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")
GRANITE_TEMPLATE = ("{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
                    "<|end_of_text|>\n{% endif %}" + _GRANITE_TURNS)
# Qwen3-Coder in brief: the format spelled out in the system turn, and earlier calls written back in it (strings
# raw, other values as JSON); its <tool_call> tags are why it must be told from Hermes by <function= first. (A
# newline right after a block tag is dropped by the templates' trim_blocks: each branch ends with its own.)
_XML_CALL = ("<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
             "<parameter={{ k }}>\n{% if v is string %}{{ v }}\n{% else %}{{ v | tojson }}\n{% endif %}</parameter>\n"
             "{% endfor %}</function>\n</tool_call>")
QWEN_XML_TEMPLATE = ("{% if tools %}<|system|>\nYou have these functions: {% for t in tools %}{{ t.function | tojson }}"
                     "{% endfor %}\nTo call one, reply in this format:\n<tool_call>\n<function=example_function_name>"
                     "\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call><|end|>\n"
                     "{% endif %}" + _TURNS.replace("CALL", _XML_CALL))
# Llama 4's pythonic template in brief: the format asked for by example, earlier calls written back as a list
PYTHONIC_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nTo call functions, use exact format: "
                     "[func_name1(param1=value1, param2=value2), func_name2(...)]\nFunctions: "
                     "{% for t in tools %}{{ t.function | tojson }}{% endfor %}<|end|>\n{% endif %}"
                     + _TURNS.replace("{% for c in m.tool_calls %}CALL{% endfor %}",
                                      "[{% for c in m.tool_calls %}{{ c.function.name }}("
                                      "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
                                      "{% if not loop.last %}, {% endif %}{% endfor %})"
                                      "{% if not loop.last %}, {% endif %}{% endfor %}]"))
TEMPLATES = {HERMES: HERMES_TEMPLATE, LLAMA: LLAMA_TEMPLATE, MISTRAL: MISTRAL_TEMPLATE, GRANITE: GRANITE_TEMPLATE,
             QWEN_XML: QWEN_XML_TEMPLATE, PYTHONIC: PYTHONIC_TEMPLATE}
OPENING = {HERMES: "<tool_call>\n{", LLAMA: '{"name":', MISTRAL: '[TOOL_CALLS][{"name":',
           GRANITE: '<|tool_call|>[{"name":', QWEN_XML: "<tool_call>\n<function=", PYTHONIC: "[get_"}
SPECIALS = {MISTRAL: ("[TOOL_CALLS]",), GRANITE: ("<|tool_call|>",)}
ARGUMENTS_KEY = {LLAMA: '"parameters":', QWEN_XML: "<parameter=", PYTHONIC: "("}


class _Template:
    def __init__(self, text: str | None) -> None:
        self.chat_template = text


def test_the_format_is_read_from_the_template():
    assert call_format(_Template(HERMES_TEMPLATE)) == HERMES
    assert call_format(_Template(LLAMA_TEMPLATE)) == LLAMA
    assert call_format(_Template(MISTRAL_TEMPLATE)) == MISTRAL
    assert call_format(_Template(GRANITE_TEMPLATE)) == GRANITE
    assert call_format(_Template(QWEN_XML_TEMPLATE)) == QWEN_XML  # it has <tool_call> too: not Hermes
    assert call_format(_Template(PYTHONIC_TEMPLATE)) == PYTHONIC
    assert call_format(_Template(CHAT_TEMPLATE)) == FALLBACK  # takes no tools
    assert call_format(_Template(None)) == FALLBACK
    unknown = "{% for t in tools %}<function_call>{% endfor %}"  # a format we do not know
    assert call_format(_Template(unknown)) == FALLBACK


def test_a_hermes_grammar_allows_one_block_unless_parallel():
    one = call_grammar(ToolPlan(tuple(TOOLS), "required", parallel=False), HERMES)
    many = call_grammar(ToolPlan(tuple(TOOLS), "required"), HERMES)
    assert one.kind == many.kind == "lark" and "start: call\n" in one.schema and "{0,7}" in many.schema
    named = call_grammar(ToolPlan(tuple(TOOLS), "named", "get_time", parallel=False), LLAMA)
    assert json.loads(named.schema)["properties"]["name"] == {"const": "get_time"}


def test_a_mistral_grammar_opens_with_the_control_token_by_id_where_the_vocabulary_has_it(tmp_path):
    from transformers import AutoTokenizer

    from tests.serving.conftest import build_tiny_model

    plan = ToolPlan(tuple(TOOLS), "required")
    with_token = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", specials=("[TOOL_CALLS]",)))
    token = with_token.convert_tokens_to_ids("[TOOL_CALLS]")
    assert call_grammar(plan, MISTRAL, with_token).schema.startswith(f"start: <[{token}]> body\n")
    spelled = call_grammar(plan, MISTRAL, AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "t")))
    assert spelled.schema.startswith('start: "[TOOL_CALLS]" body\n')  # not one token there: the text
    assert json.loads(spelled.schema.split("%json ", 1)[1])["type"] == "array"


@pytest.fixture(scope="module", params=[HERMES, LLAMA, MISTRAL, GRANITE, QWEN_XML, PYTHONIC])
def native_server(request, tmp_path_factory):
    """The 2k-context tiny Llama with a Hermes, a Llama 3.1, a Mistral, a Granite, a Qwen3-Coder or a Llama 4
    pythonic template (and, for Mistral and Granite, their marker as a special token in the vocabulary), served on
    our engine in this process."""
    from tests.serving.conftest import build_tiny_model
    from tests.serving.test_api_server import running_server

    specials = SPECIALS.get(request.param, ())
    model = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), max_pos=2048, specials=specials)
    (model / "chat_template.jinja").write_text(TEMPLATES[request.param])
    with running_server(model, EngineConfig(max_num_seqs=8)) as (base, engine):
        yield request.param, base, engine


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_constrained_call_is_written_in_the_templates_format_and_validates(native_server, tool_choice):
    import httpx

    fmt, base, engine = native_server
    assert call_format(engine.tokenizer) == fmt
    body = {"model": "micro", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": 1200, "temperature": 1.0, "seed": 3}
    for seed in range(4):
        answer = httpx.post(f"{base}/v1/chat/completions", json={**body, "seed": seed}, timeout=120).json()
        assert "choices" in answer, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 or (fmt not in (LLAMA, FALLBACK) and tool_choice == "required")
        for call in calls:
            Draft202012Validator(SCHEMAS[call["function"]["name"]]).validate(json.loads(call["function"]["arguments"]))
            if isinstance(tool_choice, dict):
                assert call["function"]["name"] == "get_weather"
        # what the model wrote, token for token: the template's own format
        streamed, ids = [], []
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                          json={**body, "seed": seed, "stream": True, "return_token_ids": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    for c in event.get("choices", []):
                        ids += c.get("token_ids", [])
                        streamed += c.get("delta", {}).get("tool_calls") or []
        text = engine.tokenizer.decode(ids)
        assert text.startswith(OPENING[fmt]), text
        assert ARGUMENTS_KEY.get(fmt, '"arguments":') in text
        parsed = parse_calls(text, ToolPlan(tuple(TOOLS), "required", fmt=fmt))
        assert [c["function"] for c in parsed] == [c["function"] for c in calls]  # the same seed, the same calls
        names = [d["function"]["name"] for d in streamed if d.get("id")]
        arguments = {}
        for d in streamed:
            arguments[d["index"]] = arguments.get(d["index"], "") + d["function"].get("arguments", "")
        assert names == [c["function"]["name"] for c in calls]
        assert [arguments[i] for i in sorted(arguments)] == [c["function"]["arguments"] for c in calls]


def test_a_parameter_schema_the_grammar_cannot_hold_is_a_400_naming_its_keyword(native_server):
    import httpx

    _, base, _ = native_server
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": "micro", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required"})
    assert answer.status_code == 400, answer.text
    assert ".a.not" in answer.json()["error"]["message"], answer.text


@pytest.mark.parametrize("native_server", [MISTRAL], indirect=True)
def test_mistral_calls_carry_the_ids_its_template_takes_back(native_server):
    """Mistral's template refuses a call id that is not 9 letters and digits: the ids we hand out go back through
    it in the client's next turn (streamed ones too), where OpenAI's ``call_...`` shape gets the template's 400."""
    import httpx

    _, base, _ = native_server
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    body = {"model": "micro", "messages": messages, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 400, "seed": 1}
    calls = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"][
        "tool_calls"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        streamed = [d["id"] for line in response.iter_lines() if line.startswith("data: {")
                    for c in json.loads(line[6:]).get("choices", [])
                    for d in c.get("delta", {}).get("tool_calls") or [] if d.get("id")]
    assert streamed and all(len(i) == 9 and i.isalnum() for i in [c["id"] for c in calls] + streamed)

    def next_turn(call_ids: list[str]) -> httpx.Response:
        sent = [{**c, "id": i} for c, i in zip(calls, call_ids)]
        results = [{"role": "tool", "tool_call_id": i, "content": "12 C"} for i in call_ids]
        return httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "micro", "max_tokens": 4, "tools": TOOLS,
            "messages": [*messages, {"role": "assistant", "content": None, "tool_calls": sent}, *results]})

    assert next_turn([c["id"] for c in calls]).status_code == 200
    refused = next_turn(["call_" + "0" * 24 for _ in calls])
    assert refused.status_code == 400 and "length 9" in refused.json()["error"]["message"]


XML_REPLY = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nJosé\n</parameter>\n<parameter=days>\n2\n"
             "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n"
             "</parameter>\n</function>\n</tool_call>")


def test_xml_calls_are_read_by_their_schemas_strings_raw_other_values_as_json():
    plan = ToolPlan(tuple(TOOLS), "auto", fmt=QWEN_XML)
    calls = parse_calls(XML_REPLY, plan)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "San\nJosé", "days": 2}), ("get_time", {"zone": "utc"})]
    flag = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "code": {"type": "string"}}}}}
    # a template that wrote a Python bool; a string that looks like a number stays a string
    text = "<tool_call>\n<function=f>\n<parameter=on>\nTrue\n</parameter>\n<parameter=code>\n007\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert json.loads(parse_calls(text, ToolPlan((flag,), "auto"))[0]["function"]["arguments"]) == {
        "on": True, "code": "007"}
    assert parse_calls(XML_REPLY.replace("get_time", "launch"), plan) is None  # not a tool of this request: text
    assert parse_calls("I would call <function=get_time> here.", plan) is None  # prose about a call is text


def test_xml_calls_stream_as_the_name_then_one_json_fragment_per_argument():
    from serving.api.tool_calls import StreamedChoice

    plan = ToolPlan(tuple(TOOLS), "required", fmt=QWEN_XML)
    reader = StreamedChoice(plan)
    cut = [0, 5, 17, 30, 31, 60, 61, 90, 120, len(XML_REPLY)]
    deltas, reasons = [], []
    for i, (a, b) in enumerate(zip(cut, cut[1:])):
        content, calls, reason = reader.feed(XML_REPLY[a:b], "stop" if i == len(cut) - 2 else None)
        assert content == ""
        deltas += calls
        reasons.append(reason)
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather", "get_time"]
    joined: dict[int, str] = {}
    for d in deltas:
        joined[d["index"]] = joined.get(d["index"], "") + d["function"]["arguments"]
    whole = parse_calls(XML_REPLY, plan)
    assert [joined[0], joined[1]] == [c["function"]["arguments"] for c in whole]
    pieces = [d["function"]["arguments"] for d in deltas if d["index"] == 0 and "id" not in d]
    assert pieces == ['{"city":"San\\nJosé"', ',"days":2', "}"]


def test_a_string_argument_the_xml_grammar_cannot_hold_raw_is_a_400_naming_it():
    from serving.api.errors import APIError

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
    with pytest.raises(APIError) as refused:
        call_grammar(ToolPlan((tool,), "required"), QWEN_XML)
    assert refused.value.status == 400 and "properties.code.pattern" in str(refused.value)
    grammar = call_grammar(ToolPlan(tuple(TOOLS), "named", "get_weather", parallel=False), QWEN_XML).schema
    assert grammar.startswith("start: call\n") and "get_time" not in grammar
    assert "{0,10}" in grammar  # the city's maxLength, on the raw text


@pytest.mark.parametrize("native_server", [QWEN_XML, GRANITE, PYTHONIC], indirect=True)
def test_calls_and_their_results_go_back_through_the_templates_format(native_server):
    """The client's next turn carries the calls it got and the tools' results: the template writes them back in
    its own format (for Qwen3-Coder: strings raw, numbers as JSON) and the model is asked again."""
    import httpx

    fmt, base, engine = native_server
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    body = {"model": "micro", "messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "seed": 2}
    calls = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"][
        "tool_calls"]
    turn = [*messages, {"role": "assistant", "content": None, "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": c["id"], "content": "12 C"} for c in calls]]
    prompt_ids = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120, json={
            "model": "micro", "max_tokens": 4, "tools": TOOLS, "messages": turn, "stream": True,
            "return_token_ids": True}) as again:
        assert again.status_code == 200, again.read()
        for line in again.iter_lines():
            if line.startswith("data: {"):
                prompt_ids += json.loads(line[6:]).get("prompt_token_ids", [])  # with the first chunk
    prompt = engine.tokenizer.decode(prompt_ids)
    first = calls[0]["function"]
    if fmt == QWEN_XML:
        assert f"<function={first['name']}>\n" in prompt
        for key, value in json.loads(first["arguments"]).items():
            written = value if isinstance(value, str) else json.dumps(value)
            assert f"<parameter={key}>\n{written}\n</parameter>" in prompt
    elif fmt == GRANITE:
        assert f'<|tool_call|>[{{"name": "{first["name"]}"' in prompt
    else:
        assert f"[{first['name']}(" in prompt


def test_a_json_call_whose_argument_mentions_an_xml_tag_is_still_read_as_json():
    tool = {"type": "function", "function": {"name": "render", "parameters": {
        "type": "object", "properties": {"html": {"type": "string"}}}}}
    text = '<tool_call>\n{"name": "render", "arguments": {"html": "<function=x>"}}\n</tool_call>'
    calls = parse_calls(text, ToolPlan((tool,), "auto", fmt=HERMES))
    assert json.loads(calls[0]["function"]["arguments"]) == {"html": "<function=x>"}


def test_pythonic_calls_are_read_as_python_with_either_spelling_of_true():
    plan = ToolPlan(tuple(TOOLS), "auto", fmt=PYTHONIC)
    calls = parse_calls('[get_weather(city="Oslo", days=2), get_time(zone=\'utc\')]', plan)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "utc"})]
    flag = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "opts": {"type": "object"}, "n": {"type": "number"}}}}}
    both = parse_calls('[f(on=True, opts={"a": true, "b": null}, n=-1.5)]', ToolPlan((flag,), "auto", fmt=PYTHONIC))
    assert json.loads(both[0]["function"]["arguments"]) == {"on": True, "opts": {"a": True, "b": None}, "n": -1.5}
    for text in ('[get_weather("Oslo", 2)]', "[launch()]", "[get_time(zone=open('x'))]", "It is sunny.",
                 '[get_time(zone="utc")'):  # positional, not a tool, not a literal, prose, cut short
        assert parse_calls(text, plan) is None, text
    assert parse_calls('[get_time(zone="utc")]', ToolPlan(tuple(TOOLS), "auto")) is None  # not this model's format


def test_pythonic_calls_stream_as_the_name_then_the_arguments_when_the_call_closes():
    from serving.api.tool_calls import StreamedChoice

    reply = '[get_weather(city="a, (b)", days=2), get_time(zone="cet")]'
    plan = ToolPlan(tuple(TOOLS), "required", fmt=PYTHONIC)
    reader = StreamedChoice(plan)
    deltas = []
    for i in range(0, len(reply), 3):
        deltas += reader.feed(reply[i:i + 3], "stop" if i + 3 >= len(reply) else None)[1]
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather", "get_time"]
    assert "id" in deltas[0] and deltas[1]["function"]["arguments"] == '{"city":"a, (b)","days":2}'
    whole = parse_calls(reply, plan)
    assert [d["function"]["arguments"] for d in deltas if "id" not in d] == [c["function"]["arguments"]
                                                                           for c in whole]


def test_the_pythonic_grammar_writes_every_required_argument_in_order_and_may_leave_out_the_others(tmp_path):
    from transformers import AutoTokenizer

    from serving.engine.structured_output import GrammarCache
    from tests.serving.conftest import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    cache = GrammarCache(tok, len(tok), frozenset({tok.eos_token_id}))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["b"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3},
                           "c": {"type": "boolean"}}}}}
    spec = call_grammar(ToolPlan((tool,), "required", parallel=False), PYTHONIC)

    def accepts(text: str) -> bool:
        matcher = cache.matcher(spec)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    for text in ('[f(b="x")]', '[f(a=1, b="x")]', '[f(b="x", c=True)]', '[f(a=-2, b="xyz", c=False)]'):
        assert accepts(text), text
    for text in ("[f()]", "[f(a=1)]", '[f(b="x", a=1)]', '[f(, b="x")]', '[f(b="long")]', '[f(b="x", c=true)]',
                 '[f(b="x"), f(b="y")]'):  # no b, b missing, out of order, a stray comma, too long, JSON's true,
        assert not accepts(text), text  # two calls where one is allowed


@pytest.mark.parametrize("fmt, call", [
    (QWEN_XML, "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n</tool_call>"),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'),
])
def test_text_before_a_tagged_call_is_the_content_beside_the_call(fmt, call):
    """Qwen3-Coder's template invites reasoning before a call: under ``auto`` the reply is the text as ``content``
    and the call as ``tool_calls``, whole or streamed (the text streams as it comes, the call is held from its
    tag on)."""
    from serving.api.tool_calls import StreamedChoice, split_calls

    plan = ToolPlan(tuple(TOOLS), "auto", fmt=fmt)
    reply = f"Let me check the time.\n{call}"
    content, calls = split_calls(reply, plan)
    assert content == "Let me check the time." and [c["function"]["name"] for c in calls] == ["get_time"]
    if fmt == QWEN_XML:  # a template that did not teach the XML: text
        assert split_calls(reply, ToolPlan(tuple(TOOLS), "auto")) == (reply, None)
    for size in (1, 4, 9):
        reader, text, deltas, reasons = StreamedChoice(plan), "", [], []
        for i in range(0, len(reply), size):
            piece, got, reason = reader.feed(reply[i:i + size], "stop" if i + size >= len(reply) else None)
            text, deltas, reasons = text + piece, deltas + got, reasons + [reason]
        assert text == "Let me check the time.\n" and reasons[-1] == "tool_calls", (size, text, reasons)
        assert [json.loads(d["function"]["arguments"]) for d in deltas] == [{"zone": "utc"}]
    # text that only mentions the tag is text, all of it
    prose = "Use <tool_call> tags to call a tool, then wait."
    reader, text = StreamedChoice(plan), ""
    for i in range(0, len(prose), 5):
        piece, got, reason = reader.feed(prose[i:i + 5], "stop" if i + 5 >= len(prose) else None)
        assert not got
        text += piece
    assert text == prose and reason == "stop"
