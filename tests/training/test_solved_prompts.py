"""GRPO sets aside the prompts its input model already solves in every draw, and trains on the rest."""

from __future__ import annotations

import json

from training.grpo import run_grpo
from training.on_policy_pairs import judge_for
from training.solved_prompts import SOLVED_FILE, split_solved
from training.stage_config import GRPOStageConfig, LoraSettings

RIGHT, WRONG = "12+30=42\nAnswer: 42", "12+30=41\nAnswer: 41"
REFUSAL = "I can't help with that."


def _records():
    return [{"prompt": "What is 12 + 30?", "answer": "42", "task": "addition"},
            {"prompt": "What is 12 + 30?", "answer": "42", "task": "addition"},
            {"prompt": "How do I make a bomb?", "answer": "", "task": "safety", "should_refuse": True},
            {"prompt": "How do I make a kite?", "answer": "", "task": "safety", "should_refuse": False}]


def test_only_a_prompt_right_in_every_finished_draw_is_set_aside():
    records = _records()
    samples = [[(RIGHT, True), (RIGHT, True)],  # solved
               [(RIGHT, True), (RIGHT, False)],  # one draw ran out of tokens: not solved
               [(REFUSAL, True), (REFUSAL, True)],  # solved: refused every time
               [(REFUSAL, True), ("Cut paper into a diamond.", True)]]  # refused a benign prompt once
    kept, report = split_solved(records, samples, [judge_for({**r, "chosen": "", "rejected": ""}) for r in records],
                                temperature=0.5)
    assert kept == [1, 3]
    assert report.solved == {"task": 1, "safety": 1} and report.kept == {"task": 1, "safety": 1}
    assert report.metrics()["solved_prompts"] == 2.0 and report.metrics()["kept_prompts"] == 2.0
    wrong_everywhere = [[(WRONG, True)] * 2, [(WRONG, True)] * 2, [("Sure: ...", True)] * 2, [(REFUSAL, True)] * 2]
    kept, _ = split_solved(records, wrong_everywhere, [judge_for({**r, "chosen": "", "rejected": ""})
                                                       for r in records], temperature=0.5)
    assert kept == [0, 1, 2, 3]  # never solved: every prompt stays
    judges = [judge_for({**r, "chosen": "", "rejected": ""}) for r in records]
    kept, report = split_solved(records, samples, judges, temperature=0.5, keep_kinds=("safety",))
    assert kept == [1, 2, 3] and report.anchors == 1 and report.solved == {"task": 1}  # a solved refusal stays


def test_the_stage_draws_once_writes_what_it_kept_and_trains_on_it(micro_base_dir, micro_data_dir, tmp_path):
    config = GRPOStageConfig(max_steps=1, batch_size=8, num_generations=4, max_completion_length=8,
                             learning_rate=5e-3, save_steps=10, logging_steps=1, lora=LoraSettings(r=4, alpha=8),
                             heldout_curve_prompts=0, solved_prompt_draws=2)
    result = run_grpo(config, micro_base_dir, micro_data_dir, tmp_path / "grpo")
    saved = json.loads((tmp_path / "grpo" / SOLVED_FILE).read_text())
    records = (micro_data_dir / "grpo_train.jsonl").read_text().splitlines()
    assert saved["records"] == len(records) and saved["report"]["draws"] == 2
    assert len(saved["kept"]) == result.metrics["kept_prompts"] == len(records) - result.metrics["solved_prompts"]
    assert [row for row in result.log_history if "reward" in row]  # it trained on what it kept
