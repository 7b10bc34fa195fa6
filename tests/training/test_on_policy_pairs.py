"""DPO on the input model's own replies: which replies pair up (hand-written samples), and the stage end to end
on the micro model (real sampling, real TRL training)."""

from __future__ import annotations

import json

import pytest

from training.dpo import run_dpo
from training.on_policy_pairs import PAIRS_FILE, Judge, build_pairs, judge_for, mined_pairs, sample_replies
from training.stage_config import DPOStageConfig, LoraSettings

REFUSAL = "I can't help with that."


def _turn(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _record(prompt: str, chosen: str, rejected: str, **columns) -> dict:
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": _turn(chosen), "rejected": _turn(rejected),
            **columns}


SUM = _record("What is 2 + 3?", "2+3=5\nAnswer: 5", "2+3=6\nAnswer: 6")
HARMFUL = _record("Help me make a detonator.", REFUSAL, "Sure. To make a detonator, ...")
LOOKALIKE = _record("Help me make a kite.", "Sure. To make a kite, gather the materials.", REFUSAL)
UNVERIFIABLE = _record("Write a haiku.", "An old silent pond", "a pond")


def test_the_judge_is_read_from_the_columns_first_then_from_the_chosen_reply():
    assert judge_for(SUM) == Judge("task", answer="5")
    assert judge_for(HARMFUL) == Judge("safety", should_refuse=True)
    assert judge_for(LOOKALIKE) == Judge("safety", should_refuse=False)
    assert judge_for(UNVERIFIABLE) is None
    # the data stage's own columns win over what the replies say
    assert judge_for({**SUM, "answer": "7"}) == Judge("task", answer="7")
    assert judge_for({**UNVERIFIABLE, "should_refuse": True, "answer": ""}) == Judge("safety", should_refuse=True)


def test_only_prompts_with_a_wrong_sample_pair_up_and_the_own_right_reply_is_chosen():
    records = [SUM, SUM, SUM, HARMFUL, LOOKALIKE, UNVERIFIABLE]
    samples = [
        [("1+1\nAnswer: 5", True), ("Answer: 5", True)],  # all right: no pair
        [("Answer: 5", True), ("2+3=4\nAnswer: 4", True)],  # one wrong: its own right reply is chosen
        [("Answer: 9", True), ("Answer: 5", False)],  # right but cut by the token limit: never chosen
        [("Sure. To make a detonator", True), (REFUSAL, True)],  # harmful, answered once
        [(REFUSAL, True), (REFUSAL, True)],  # a look-alike refused every time
        [],  # not verifiable: not sampled
    ]
    judges = [judge_for(r) for r in records]
    pairs, report = build_pairs(records, samples, judges, temperature=1.0)
    chosen = [p["chosen"][0]["content"] for p in pairs]
    rejected = [p["rejected"][0]["content"] for p in pairs]
    assert chosen == ["Answer: 5", "2+3=5\nAnswer: 5", REFUSAL, "Sure. To make a kite, gather the materials.",
                      "An old silent pond"]
    assert rejected == ["2+3=4\nAnswer: 4", "Answer: 9", "Sure. To make a detonator", REFUSAL, "a pond"]
    assert report.pairs == {"task": 2, "safety": 2} and report.all_right == {"task": 1}
    assert report.own_chosen == 2 and report.unverifiable == 1  # the SUM with a right sample, the detonator
    assert report.sample_accuracy == {"task": pytest.approx(3 / 6), "safety": pytest.approx(1 / 4)}
    assert all(set(p) == {"prompt", "chosen", "rejected"} for p in pairs)


def _on_policy(**overrides) -> DPOStageConfig:
    values = dict(max_steps=2, batch_size=4, learning_rate=5e-3, save_steps=2, logging_steps=1,
                  lora=LoraSettings(r=4, alpha=8), heldout_curve_prompts=0, pairs="on_policy",
                  on_policy_samples=2, on_policy_max_new_tokens=24)
    values.update(overrides)
    return DPOStageConfig(**values)


def test_the_stage_trains_on_the_input_models_own_replies_mined_once(micro_base_dir, micro_data_dir, tmp_path):
    out = tmp_path / "dpo"
    result = run_dpo(_on_policy(), micro_base_dir, micro_data_dir, out)
    saved = json.loads((out / PAIRS_FILE).read_text())
    static = [json.loads(line) for line in (micro_data_dir / "pref_train.jsonl").read_text().splitlines()]
    pairs = saved["pairs"]
    assert 0 < len(pairs) <= len(static)
    # every rejected reply is one of the micro model's own draws for that prompt (drawn again: same seeds)
    config = _on_policy()
    draws = sample_replies(micro_base_dir, [r["prompt"] for r in static], config.on_policy_samples,
                           config.on_policy_temperature, config.on_policy_max_new_tokens, config.seed)
    own = {json.dumps(r["prompt"], sort_keys=True): {text for text, _ in d} for r, d in zip(static, draws)}
    assert all(p["rejected"][0]["content"] in own[json.dumps(p["prompt"], sort_keys=True)] for p in pairs)
    assert result.metrics["on_policy_pairs"] == len(pairs) and result.adapter_dir is not None
    assert any("rewards/margins" in row for row in result.log_history)  # trained on them
    # the same fingerprint reads the pairs back instead of sampling again (a resumed stage sees the same pairs)
    stamp = (out / PAIRS_FILE).stat().st_mtime_ns
    again, _ = mined_pairs(_on_policy(), micro_base_dir, static, out, saved["fingerprint"])
    assert again == pairs and (out / PAIRS_FILE).stat().st_mtime_ns == stamp
    assert run_dpo(_on_policy(), micro_base_dir, micro_data_dir, out).skipped


def test_on_policy_settings_are_checked():
    with pytest.raises(ValueError, match="pairs: must be one of static, on_policy"):
        DPOStageConfig(pairs="online")
    with pytest.raises(ValueError, match="on_policy_samples"):
        DPOStageConfig(on_policy_samples=0)
