"""The structured suite: held-out tasks asked for JSON, scored by one contract, and generated under the grammar.

The micro model never saw JSON: every constrained reply must still finish and validate (the grammar's promise),
and the promise's gate fires when replies are cut (a planted fault: too little room for the answer object)."""

from __future__ import annotations

import json

import pytest
from eval_testutil import read_jsonl

import evals.suites.structured as structured_suite
from evals.config import EvalConfig
from evals.gates import check_gates, parse_gate
from evals.generation import generate_replies
from evals.json_replies import (
    answer_schema,
    answer_tool,
    json_answer_correct,
    json_answer_reply,
    json_reply_problem,
    json_task_prompt,
    reply_token_bound,
)
from evals.results import metrics_dict
from evals.runner import run_evals


def test_the_schema_follows_the_reference_answer():
    assert list(answer_schema("42")["properties"]) == ["work", "answer"]  # the work first: it is how the sum is found
    assert answer_schema("42")["properties"]["answer"]["type"] == "integer"
    assert answer_schema("-7")["properties"]["answer"]["type"] == "integer"
    assert answer_schema("123")["properties"]["work"]["maxItems"] == 3  # a line per column, at most
    assert list(answer_schema("olleh")["properties"]) == ["answer"]
    assert answer_schema("olleh")["properties"]["answer"]["type"] == "string"
    assert answer_tool("42")["function"]["parameters"] == answer_schema("42")
    assert json_task_prompt("What is 1 + 2?", "3").startswith("What is 1 + 2?\n")
    assert '"work"' in json_task_prompt("What is 1 + 2?", "3") and '"work"' not in json_task_prompt("x", "olleh")


def test_a_teachers_reply_is_valid_right_and_the_grammars_own_form():
    reply = json_answer_reply("7+8=15\n3+4+1=8", "85")
    assert reply == '{"work":["7+8=15","3+4+1=8"],"answer":85}'
    assert json_reply_problem(reply, answer_schema("85")) is None and json_answer_correct(reply, "85")
    assert json_answer_reply("", "olleh") == '{"answer":"olleh"}'
    assert json_reply_problem(json_answer_reply("", "olleh"), answer_schema("olleh")) is None


@pytest.mark.parametrize("reference", ["7", "85", "185", "-12", "olleh", "x"])
def test_the_longest_reply_a_schema_allows_fits_its_bound(reference):
    """The bound sizes every structured reply's room: the longest valid reply, EOS included, must fit it."""
    schema = answer_schema(reference)
    if "work" in schema["properties"]:
        lines = ["9+9+1=19"] * schema["properties"]["work"]["maxItems"]
        longest = json.dumps({"work": lines, "answer": schema["properties"]["answer"]["minimum"]},
                             separators=(",", ":"))
    else:  # every character the longest escape the grammar could write
        longest = '{"answer":"' + "\\u00e9" * schema["properties"]["answer"]["maxLength"] + '"}'
    assert json_reply_problem(longest, schema) is None
    assert len(longest.encode()) + 1 == reply_token_bound(reference)


@pytest.mark.parametrize(("text", "problem"), [
    ('{"work": ["2+0=2", "4+0=4"], "answer": 42}', None),
    ('{"work":[],"answer":42}', None),
    ('{"answer": 42}', "invalid for its schema"),  # no work: required
    ('{"work": [], "answer": "42"}', "invalid for its schema"),
    ('{"work": [], "answer": 42, "why": 1}', "invalid for its schema"),
    ('{"work": [], "answer": 1000}', "invalid for its schema"),  # a digit more than the reference's, at most
    ('{"work": ["1", "2", "3"], "answer": 42}', "invalid for its schema"),  # more lines than columns
    ('{"work": ["two plus"], "answer": 42}', "invalid for its schema"),  # a line of anything but the sums
    ('{"work": ["1+1+1+1=4"], "answer": 42}', "invalid for its schema"),  # a line longer than a column's
    ('{}', "invalid for its schema"),
    ('Answer: 42', "not JSON"),
    ('{"answer": 42', "not JSON"),
])
def test_a_reply_is_valid_or_says_why(text, problem):
    found = json_reply_problem(text, answer_schema("42"))
    assert found is None if problem is None else found.startswith(problem)


def test_the_answer_is_compared_as_plain_answers_are():
    assert json_answer_correct('{"answer": 42}', "42") and json_answer_correct('{"answer": "042"}', "42")
    assert json_answer_correct('{"answer": "Olleh"}', "olleh")
    assert not json_answer_correct('{"answer": 41}', "42")
    assert not json_answer_correct('{"answer": true}', "1") and not json_answer_correct('[42]', "42")
    assert not json_answer_correct("42", "42")  # a bare number is not the object asked for


def test_constrained_replies_finish_valid_from_a_model_that_never_saw_json(micro_lm, micro_data_dir):
    records = read_jsonl(micro_data_dir / "tasks_heldout.jsonl")[:6]
    references = [r["answer"] for r in records[:3]] + ["olleh", "dlrow", "x"]  # integer and string rows in one batch
    schemas = [answer_schema(a) for a in references]
    prompts = [micro_lm.chat_prompt([{"role": "user", "content": json_task_prompt(r["prompt"], a)}])
               for r, a in zip(records, references, strict=True)]
    room = max(reply_token_bound(a) for a in references)
    free = generate_replies(micro_lm, prompts, max_new_tokens=24, batch_size=6)
    constrained = generate_replies(micro_lm, prompts, max_new_tokens=room, batch_size=6, schemas=schemas)
    assert sum(json_reply_problem(g.text, s) is None for g, s in zip(free, schemas, strict=True)) < len(free)
    for reply, schema in zip(constrained, schemas, strict=True):
        assert reply.stopped_on_eos, reply
        assert json_reply_problem(reply.text, schema) is None, reply
        assert reply.text == json.dumps(json.loads(reply.text), separators=(",", ":"))  # no free whitespace
    # batching changes nothing: a row's grammar is its own
    alone = generate_replies(micro_lm, prompts[4:5], max_new_tokens=room, batch_size=1, schemas=schemas[4:5])
    assert alone == constrained[4:5]


def test_the_suite_keeps_its_promise_and_its_gate_fires_on_cut_replies(micro_base_dir, micro_data_dir, monkeypatch):
    gate = parse_gate("constrained_validity >= 1.0")
    config = EvalConfig(suites=["structured"], max_new_tokens=40, structured_examples=6)
    results = run_evals(micro_base_dir, micro_data_dir, config)
    metrics = metrics_dict(results)
    assert [r.metric for r in results] == ["json_schema_adherence", "constrained_validity", "constrained_task_accuracy"]
    assert {r.n for r in results} == {6}
    assert metrics["constrained_validity"] == 1.0 and check_gates(results, [gate]).passed
    assert 0.0 <= metrics["constrained_task_accuracy"] <= 1.0
    tasks = {r["task"] for r in read_jsonl(micro_data_dir / "tasks_heldout.jsonl")}
    assert {k for k in results[1].slices if k in tasks} == tasks  # the prefix keeps every task

    # the room is at least the longest reply's (`reply_token_bound`), whatever max_new_tokens says: 3 is not cut
    roomy = run_evals(micro_base_dir, micro_data_dir, EvalConfig(suites=["structured"], max_new_tokens=3,
                                                                  structured_examples=6))
    assert metrics_dict(roomy)["constrained_validity"] == 1.0
    # a planted fault (patched on purpose): a bound too small for the answer object, so replies are cut
    monkeypatch.setattr(structured_suite, "reply_token_bound", lambda reference: 3)
    cut = run_evals(micro_base_dir, micro_data_dir, EvalConfig(suites=["structured"], max_new_tokens=3,
                                                                structured_examples=6))
    report = check_gates(cut, [gate])
    assert metrics_dict(cut)["constrained_validity"] < 1.0 and not report.passed
    assert "constrained_validity: measured" in report.summary()


def test_structured_examples_must_be_positive():
    with pytest.raises(ValueError, match="structured_examples"):
        EvalConfig(structured_examples=0)
