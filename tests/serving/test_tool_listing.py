"""The fallback's tool listing: a signature line per function, short enough for a small model's context, and
still saying every parameter, its type and whether it is required."""

from __future__ import annotations

from serving.api.tool_calls import CONSTRAINED_HEADER, FALLBACK_INSTRUCTIONS, ToolPlan, fallback_messages
from serving.api.tool_listing import listing, signature, type_of

WEATHER = {"name": "get_weather", "description": "Get the\n  forecast.",
           "parameters": {"type": "object", "required": ["city"], "properties": {
               "city": {"type": "string", "description": "a city"},
               "unit": {"enum": ["c", "f"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}


def test_a_signature_names_every_parameter_its_type_and_whether_it_is_required():
    assert signature(WEATHER) == 'get_weather(city: string, unit?: "c" | "f", days?: integer) - Get the forecast.'
    assert signature({"name": "now"}) == "now()"
    assert signature({"name": "ping", "parameters": {"type": "object", "properties": {}}}) == "ping()"


def test_types_nest_as_a_reader_expects():
    root = {"$defs": {"point": {"type": "object", "required": ["x", "y"],
                                "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}
    assert type_of({"type": "array", "items": {"$ref": "#/$defs/point"}}, root) == "{x: number, y: number}[]"
    assert type_of({"type": "array", "items": {"enum": ["a", "b"]}}, root) == '("a" | "b")[]'
    assert type_of({"type": ["string", "null"]}, root) == "string | null"
    assert type_of({"anyOf": [{"type": "integer"}, {"const": "all"}]}, root) == 'integer | "all"'
    assert type_of({"type": "object"}, root) == "object"
    assert type_of({}, root) == "any"
    assert type_of({"$ref": "https://example.com/schemas/Address"}, root) == "Address"


def test_a_recursive_schema_ends():
    root = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                             "items": {"$ref": "#/$defs/node"}}}}}}
    shown = type_of({"$ref": "#/$defs/node"}, root)
    assert shown.startswith("{children?: {children?: ") and shown.count("children") < 8


def test_the_rollouts_tool_probe_fits_the_embedded_models_context(micro_base_dir):
    """The answer tool a rollout probe offers, with a held-out task, in the embedded model's 256 tokens with room
    for the reply (as JSON Schema the listing alone took ~360)."""
    from transformers import AutoTokenizer

    from evals.json_replies import answer_tool
    from serving.rollout.probes import ProbeItem, structured_max_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(micro_base_dir))
    tool = answer_tool("198")  # the largest embedded sum: the most work lines and answer digits
    messages = fallback_messages([{"role": "user", "content": "What is 99 + 99?"}],
                                 ToolPlan((tool,), "named", tool["function"]["name"], parallel=False))
    assert messages[0]["content"] == CONSTRAINED_HEADER + signature(tool["function"])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    room = structured_max_tokens(ProbeItem("tool", "What is 99 + 99?", "198"))
    assert len(prompt) + room <= 256, (len(prompt), room)


def test_a_listing_is_a_line_per_function():
    assert listing([WEATHER, {"name": "now"}]).splitlines()[1] == "now()"


def test_only_a_free_choice_is_taught_the_call_format_and_a_system_message_keeps_its_text():
    """Under ``auto`` the model must be told how to write a call; under a grammar the grammar writes it."""
    tools = ({"type": "function", "function": WEATHER},)
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    free = fallback_messages(user, ToolPlan(tools, "auto"))[0]["content"]
    held = fallback_messages(user, ToolPlan(tools, "required"))[0]["content"]
    assert free == f"Be brief.\n\n{FALLBACK_INSTRUCTIONS}{signature(WEATHER)}"
    assert held == f"Be brief.\n\n{CONSTRAINED_HEADER}{signature(WEATHER)}"
    assert len(fallback_messages(user, ToolPlan(tools, "auto"))) == 2  # merged into the system message
