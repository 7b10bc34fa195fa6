"""GRPO with the SFT chats replayed in its loss (training.sft_replay, PPO-ptx): the chats as the loss sees them,
and a real GRPO stage on the micro model that holds them closer than the same stage without the replay."""

from __future__ import annotations

import json

import pytest
import torch

from training.grpo import run_grpo
from training.sft_replay import IGNORE, load_replay_chats, replay_batches
from training.stage_config import GRPOStageConfig, LoraSettings, TrainingError


@pytest.fixture(scope="module")
def tokenizer(micro_base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_base_dir)


def test_only_the_replies_are_trained_on(micro_data_dir, tokenizer):
    chats = load_replay_chats(micro_data_dir, tokenizer, max_len=4096)
    lines = [json.loads(line) for line in (micro_data_dir / "sft_train.jsonl").read_text().splitlines()]
    assert len(chats) == len(lines)
    first = lines[0]["messages"]
    prompt = tokenizer.apply_chat_template(first[:-1], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(chats[0].input_ids[:chats[0].prompt_len]) == prompt
    assert first[-1]["content"] in tokenizer.decode(chats[0].input_ids[chats[0].prompt_len:])

    batch = next(replay_batches(chats, 4, seed=0, pad_id=tokenizer.pad_token_id))
    labels, mask = batch["labels"], batch["attention_mask"]
    assert batch["input_ids"].shape == labels.shape == mask.shape and labels.shape[0] == 4
    for row in range(4):
        trained = (labels[row] != IGNORE).nonzero().flatten()
        # the reply is trained and nothing else: not the prompt before it, not the padding after it
        assert trained.numel() > 0 and bool(mask[row, trained].all())
        assert torch.equal(labels[row, trained], batch["input_ids"][row, trained])
        assert int(trained[-1]) + 1 == int(mask[row].sum())


def test_each_pass_replays_every_chat_once_in_a_seeded_order(micro_data_dir, tokenizer):
    chats = load_replay_chats(micro_data_dir, tokenizer, max_len=4096)[:12]

    def firsts(seed: int) -> list[list[int]]:
        batches = replay_batches(chats, 4, seed, tokenizer.pad_token_id)
        rows = [row for _ in range(3) for row in next(batches)["input_ids"].tolist()]
        return [[t for t in row if t != tokenizer.pad_token_id][:12] for row in rows]

    once = firsts(0)
    assert sorted(once) == sorted(c.input_ids[:12] for c in chats)  # 3 batches of 4: each of the 12 once
    assert firsts(0) == once and firsts(1) != once


def test_long_chats_are_cut_and_a_missing_file_is_named(micro_data_dir, tokenizer, tmp_path):
    longest = max(len(c.input_ids) for c in load_replay_chats(micro_data_dir, tokenizer, max_len=4096))
    cut = load_replay_chats(micro_data_dir, tokenizer, max_len=longest - 5)
    assert max(len(c.input_ids) for c in cut) == longest - 5
    with pytest.raises(TrainingError, match=r"sft_train.jsonl not found"):
        load_replay_chats(tmp_path, tokenizer, max_len=64)
    (tmp_path / "sft_train.jsonl").write_text('{"prompt": "no messages"}\n')
    with pytest.raises(TrainingError, match=r"sft_train.jsonl: line 1: not an SFT chat"):
        load_replay_chats(tmp_path, tokenizer, max_len=64)


@pytest.mark.parametrize("field,value", [("sft_replay_weight", -0.5), ("sft_replay_batch", 0)])
def test_bad_replay_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOStageConfig(**{field: value})


def _sft_nll(model_dir, data_dir, tokenizer) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    chats = load_replay_chats(data_dir, tokenizer, max_len=4096)
    batch = next(replay_batches(chats, len(chats), seed=0, pad_id=tokenizer.pad_token_id))
    with torch.no_grad():
        return float(model(**batch).loss)


def test_grpo_with_the_replay_stays_closer_to_the_sft_chats(micro_base_dir, micro_data_dir, tokenizer, tmp_path):
    # the same GRPO stage twice from the micro model, with and without the replay: the replayed run logs the
    # chats' NLL every step and ends with them more likely than the run that only followed its rewards
    def grpo(weight: float):
        config = GRPOStageConfig(max_steps=4, batch_size=8, num_generations=4, max_completion_length=8, beta=0.05,
                                 learning_rate=5e-3, save_steps=4, logging_steps=1, lora=LoraSettings(r=4, alpha=8),
                                 heldout_curve_prompts=2, solved_prompt_draws=0, sft_replay_weight=weight,
                                 sft_replay_batch=8)
        return run_grpo(config, micro_base_dir, micro_data_dir, tmp_path / f"grpo-{weight}")

    plain, replayed = grpo(0.0), grpo(2.0)
    steps = [row for row in replayed.log_history if "reward" in row]
    assert len(steps) == 4 and all(row["sft_replay_nll"] > 0 for row in steps)
    assert not any("sft_replay_nll" in row for row in plain.log_history)
    before = _sft_nll(micro_base_dir, micro_data_dir, tokenizer)
    after_plain = _sft_nll(plain.output_dir, micro_data_dir, tokenizer)
    after_replayed = _sft_nll(replayed.output_dir, micro_data_dir, tokenizer)
    assert after_replayed < min(before, after_plain) - 0.05, (before, after_plain, after_replayed)
