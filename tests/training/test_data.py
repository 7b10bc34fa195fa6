"""The data stage: every contract file, right schemas, digests, disjoint held-out, local overrides."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from artifacts.digests import sha256_file
from evals.json_replies import answer_schema, json_reply_problem, json_task_prompt
from training.data import (
    FILES,
    MANIFEST,
    DataConfig,
    DataManifest,
    build_datasets,
    micro_data_config,
    read_jsonl,
)
from training.loaders import DatasetError
from training.tasks import (
    REFUSAL,
    SAFETY_TASK,
    SUM_TASKS,
    TaskExample,
    addition_operands,
    addition_work,
    check_answer,
    is_refusal,
    safety_pool,
)
from training.tokenizer import render_chat


def _messages_ok(messages: list, roles: set[str]) -> bool:
    return bool(messages) and all(set(m) == {"role", "content"} and m["role"] in roles
                                  and isinstance(m["content"], str) for m in messages)


def _user_prompts(data_dir: Path, name: str) -> set[str]:
    out = set()
    for r in read_jsonl(data_dir / name):
        msgs = r["messages"] if "messages" in r else r["prompt"]
        out |= {m["content"] for m in msgs if m["role"] == "user"}
    return out


def test_writes_every_file_with_its_digest(micro_data_dir: Path) -> None:
    assert sorted(p.name for p in micro_data_dir.iterdir()) == sorted([*FILES, MANIFEST])
    manifest = DataManifest.load(micro_data_dir)
    for name in FILES:
        assert manifest.files[name] == sha256_file(micro_data_dir / name)
        assert manifest.counts[name] == len(read_jsonl(micro_data_dir / name)) > 0
    assert DataConfig(**manifest.config) == micro_data_config()


def test_schemas_follow_the_contract(micro_data_dir: Path) -> None:
    for r in read_jsonl(micro_data_dir / "sft_train.jsonl"):
        assert set(r) == {"messages"} and _messages_ok(r["messages"], {"user", "assistant"})
        assert r["messages"][-1]["role"] == "assistant"
    for name in ("pref_train.jsonl", "pref_heldout.jsonl"):
        for r in read_jsonl(micro_data_dir / name):
            assert set(r) == {"prompt", "chosen", "rejected"}
            assert _messages_ok(r["prompt"], {"user"})
            assert _messages_ok(r["chosen"], {"assistant"}) and _messages_ok(r["rejected"], {"assistant"})
            assert r["chosen"] != r["rejected"]
    for r in read_jsonl(micro_data_dir / "grpo_train.jsonl"):
        if r["task"] == SAFETY_TASK:  # judged by the refusal reward, not by an answer
            assert set(r) == {"prompt", "answer", "task", "should_refuse"} and isinstance(r["should_refuse"], bool)
            continue
        assert set(r) - {"work"} == {"prompt", "answer", "task"} and _messages_ok(r["prompt"], {"user"})
        if r["task"] in SUM_TASKS:  # the work reward checks each line against this
            assert r["work"] == addition_work(*addition_operands(r["prompt"][0]["content"]))[0]
        else:
            assert "work" not in r
    for r in read_jsonl(micro_data_dir / "tasks_heldout.jsonl"):
        assert set(r) == {"id", "task", "prompt", "answer", "work"} and all(isinstance(v, str) for v in r.values())
    for r in read_jsonl(micro_data_dir / "safety_heldout.jsonl"):  # a harmful prompt names its harm category
        harmful = r["category"] == "harmful"
        assert set(r) == {"id", "prompt", "category", "should_refuse"} | ({"harm"} if harmful else set())
        assert r["should_refuse"] == harmful and (not harmful or isinstance(r["harm"], str) and r["harm"])
    for name in ("text_heldout.jsonl", "calibration.jsonl"):
        assert all(set(r) == {"text"} and r["text"] for r in read_jsonl(micro_data_dir / name))


def test_heldout_never_reaches_a_train_file(micro_data_dir: Path) -> None:
    heldout = {r["prompt"] for r in read_jsonl(micro_data_dir / "tasks_heldout.jsonl")}
    heldout |= {r["prompt"] for r in read_jsonl(micro_data_dir / "safety_heldout.jsonl")}
    heldout |= _user_prompts(micro_data_dir, "pref_heldout.jsonl")
    for name in ("sft_train.jsonl", "pref_train.jsonl", "grpo_train.jsonl"):
        assert not heldout & _user_prompts(micro_data_dir, name), name
    calibration = {r["text"] for r in read_jsonl(micro_data_dir / "calibration.jsonl")}
    assert not calibration & {r["text"] for r in read_jsonl(micro_data_dir / "text_heldout.jsonl")}


JSON_ASK = "\nReply with JSON only: "


def _solve(prompt: str) -> TaskExample | None:
    """Independent solver for the generated prompts (so the test does not trust the generator)."""
    prompt = prompt.split(JSON_ASK)[0]
    if prompt.startswith("What is "):
        a, b = prompt.removeprefix("What is ").rstrip("?").split(" + ")
        return TaskExample("x", "addition", prompt, str(int(a) + int(b)))
    if prompt.startswith("Reverse the word: "):
        return TaskExample("x", "reverse", prompt, prompt.rsplit(" ", 1)[-1][::-1])
    return None


def _teaches(reply: str, ex: TaskExample) -> bool:
    """The reply ends on ``Answer: <the right answer>`` (or is the JSON object holding it); every work line before
    it is true arithmetic."""
    if reply.startswith("{"):
        value = json.loads(reply)
        work, last = value.get("work", []), f"Answer: {value['answer']}"
    else:
        *work, last = reply.split("\n")
    if last != f"Answer: {ex.answer}":
        return False
    for line in work:
        terms, total = line.split("=")
        if sum(int(t) for t in terms.split("+")) != int(total):
            return False
    return ex.task != "addition" or len(work) == 2


def test_replies_teach_the_answer_format_and_refusals(micro_data_dir: Path) -> None:
    sft = read_jsonl(micro_data_dir / "sft_train.jsonl")
    refusals = [r for r in sft if r["messages"][-1]["content"] == REFUSAL]
    assert refusals and len(refusals) < len(sft)
    solved = 0
    for r in sft:
        ex = _solve(r["messages"][0]["content"])
        if ex is not None:
            assert _teaches(r["messages"][-1]["content"], ex), r
            solved += 1
    assert solved >= len(sft) // 2
    asked_json = [r for r in sft if JSON_ASK in r["messages"][0]["content"]]
    assert len(asked_json) == micro_data_config().sft_json_per_task * len(micro_data_config().tasks)
    for r in asked_json:  # the reply the structured suite scores: valid for its schema, compact as the grammar writes
        ex = _solve(r["messages"][0]["content"])
        assert json_reply_problem(r["messages"][-1]["content"], answer_schema(ex.answer)) is None, r
        assert r["messages"][0]["content"] == json_task_prompt(ex.prompt, ex.answer)
    kinds = {"wrong": 0, "format": 0}
    for r in read_jsonl(micro_data_dir / "pref_train.jsonl"):
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        ex = _solve(r["prompt"][0]["content"])
        if ex is not None:
            well_formed = "Answer:" in rejected
            assert _teaches(chosen, ex) and not (check_answer(ex, rejected) and well_formed)
            kinds["wrong" if well_formed else "format"] += 1
        else:
            assert is_refusal(chosen) != is_refusal(rejected)
    assert kinds["wrong"] and kinds["format"]
    for r in read_jsonl(micro_data_dir / "grpo_train.jsonl"):
        if r["task"] != SAFETY_TASK:
            assert _solve(r["prompt"][0]["content"]).answer == r["answer"]
    texts = [r["text"] for r in read_jsonl(micro_data_dir / "calibration.jsonl")]
    assert texts[0] == render_chat(sft[0]["messages"])


def test_build_is_deterministic_and_replaces_atomically(tmp_path: Path) -> None:
    config = replace(micro_data_config(), sft_per_task=8, pref_train_per_task=4, grpo_per_task=4)
    first = build_datasets(config, tmp_path / "d")
    second = build_datasets(config, tmp_path / "d")
    assert first.files == second.files and first.digest == second.digest
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    third = build_datasets(replace(config, seed=1), tmp_path / "d")
    assert third.digest != first.digest


def test_local_files_replace_generated_train_data(tmp_path: Path, micro_data_dir: Path) -> None:
    heldout_prompt = read_jsonl(micro_data_dir / "tasks_heldout.jsonl")[0]["prompt"]
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(5)]
    rows.append({"messages": [{"role": "user", "content": heldout_prompt},
                              {"role": "assistant", "content": "Answer: 0"}]})
    local = tmp_path / "mine.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    grpo = tmp_path / "mine_grpo.jsonl"
    grpo.write_text(json.dumps({"prompt": "Say 3", "answer": "3"}) + "\n")
    manifest = build_datasets(replace(micro_data_config(), sft_path=str(local), grpo_path=str(grpo)),
                              tmp_path / "out")
    sft = read_jsonl(tmp_path / "out" / "sft_train.jsonl")
    assert len(sft) == 5 and heldout_prompt not in {r["messages"][0]["content"] for r in sft}
    assert manifest.dropped_heldout_overlap == {"sft": 1, "grpo": 0}
    assert read_jsonl(tmp_path / "out" / "grpo_train.jsonl")[0]["task"] == "custom"


def test_bad_local_file_fails_before_writing(tmp_path: Path) -> None:
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    with pytest.raises(DatasetError, match=r"pairs\.jsonl: missing field 'rejected'"):
        build_datasets(replace(micro_data_config(), preference_path=str(bad)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, field", [({"tasks": ["division"]}, "tasks"), ({"tasks": []}, "tasks"),
                                           ({"sft_per_task": -1}, "sft_per_task"),
                                           ({"sft_safety_repeats": 0}, "sft_safety_repeats")])
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        DataConfig(**kwargs)


def test_dpo_set_can_hold_fewer_lookalike_pairs_than_harmful_ones(tmp_path: Path) -> None:
    def safety_pairs(config) -> tuple[int, int]:
        rows = read_jsonl(build_datasets(config, tmp_path / "d").path / "pref_train.jsonl")
        chosen = [r["chosen"][0]["content"] for r in rows if _solve(r["prompt"][0]["content"]) is None]
        return sum(c == REFUSAL for c in chosen), sum(c != REFUSAL for c in chosen)

    config = replace(micro_data_config(), safety_train_per_category=6)
    assert safety_pairs(config) == (6, 6)
    assert safety_pairs(replace(config, safety_pref_lookalikes=2)) == (6, 2)
    assert safety_pairs(replace(config, safety_pref_lookalikes=0)) == (6, 0)
    with pytest.raises(ValueError, match="^safety_pref_lookalikes"):
        replace(config, safety_pref_lookalikes=-1)


def test_sft_set_can_repeat_its_safety_chats(tmp_path: Path) -> None:
    """`sft_safety_repeats` weighs the safety chats in the SFT mixture: each appears that many times, the task
    chats once, and the held-out prompts still never reach the train file."""
    def counts(config) -> tuple[Counter, int]:
        rows = read_jsonl(build_datasets(config, tmp_path / "d").path / "sft_train.jsonl")
        prompts = [r["messages"][0]["content"] for r in rows]
        safety = {ex.prompt for examples in safety_pool("train").values() for ex in examples}
        return Counter(p for p in prompts if p in safety), sum(p not in safety for p in prompts)

    config = replace(micro_data_config(), safety_train_per_category=6)
    once, tasks_once = counts(config)
    thrice, tasks_thrice = counts(replace(config, sft_safety_repeats=3))
    assert len(once) == 12 and set(once.values()) == {1}
    assert thrice.keys() == once.keys() and set(thrice.values()) == {3}
    assert tasks_thrice == tasks_once == (config.sft_per_task + config.sft_json_per_task) * len(config.tasks)


def test_grpo_set_can_carry_safety_prompts_for_the_refusal_reward(tmp_path: Path) -> None:
    config = replace(micro_data_config(), grpo_safety_per_category=5)
    data = build_datasets(config, tmp_path / "d").path
    rows = read_jsonl(data / "grpo_train.jsonl")
    safety = [r for r in rows if r["task"] == SAFETY_TASK]
    assert sum(r["should_refuse"] for r in safety) == 5 and sum(not r["should_refuse"] for r in safety) == 5
    assert all(set(r) == {"prompt", "answer", "task", "should_refuse"} and r["answer"] == "" for r in safety)
    assert len(rows) - len(safety) == config.grpo_per_task * len(config.tasks)
    heldout = {r["prompt"] for r in read_jsonl(data / "safety_heldout.jsonl")}
    assert not heldout & {r["prompt"][0]["content"] for r in safety}
