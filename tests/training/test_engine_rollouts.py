"""GRPO's rollouts on the serving engine: the synced adapter is the trainer's policy, step after step."""

from __future__ import annotations

import logging

import pytest
import torch

from training.engine_rollouts import EngineRollouts, RolloutSampling, adapter_weights, why_not_engine
from training.grpo import run_grpo
from training.lora import attach_adapters, load_base_model
from training.stage_config import GRPOStageConfig, LoraSettings, TrainingError


def _policy(model_dir, seed: int):
    """The micro model under fresh LoRA adapters whose B is not zero (a fresh adapter is the identity)."""
    torch.manual_seed(seed)
    model = attach_adapters(load_base_model(model_dir, LoraSettings(r=4, alpha=8), _cpu()), LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model.eval()


def _cpu():
    from training.hardware import Hardware

    return Hardware(device="cpu", bf16=False)


def _prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    questions = ["What is 12 + 30?", "What is 7 + 8?", "How do I make a kite?"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for q in questions]


def _hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: list[int]) -> list[list[int]]:
    replies = []
    with torch.no_grad():
        for ids in prompts:
            prompt = torch.tensor([ids])
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=model.config.pad_token_id)
            out = out[0, len(ids):].tolist()
            stop = next((i for i, t in enumerate(out) if t in eos), None)
            replies.append(out if stop is None else out[:stop + 1])  # TRL keeps the first stop token
    return replies


def _greedy(max_tokens: int, eos: list[int]) -> RolloutSampling:
    return RolloutSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                           max_tokens=max_tokens, stop_token_ids=tuple(eos))


def _rollouts(model_dir, prompts) -> EngineRollouts:
    return EngineRollouts.start(model_dir, device="cpu", bf16=False, rank=4, max_seqs=8,
                                longest_prompt=max(map(len, prompts)), max_completion=12, seed=0)


def test_the_synced_engine_writes_the_policys_own_replies_and_follows_its_updates(micro_base_dir):
    from artifacts.common.stop_tokens import stop_token_ids

    prompts = _prompts(micro_base_dir)
    eos = stop_token_ids(micro_base_dir, None) or [2]
    rollouts = _rollouts(micro_base_dir, prompts)
    first, second = _policy(micro_base_dir, seed=1), _policy(micro_base_dir, seed=2)
    rollouts.sync(first, step=0)
    assert rollouts.generate(prompts, _greedy(12, eos)) == _hf_greedy(first, prompts, 12, eos)
    rollouts.sync(second, step=0)  # the same step: no new sync
    assert rollouts.syncs == 1
    rollouts.sync(second, step=1)  # the next step: the new weights, and no block cached under the old ones
    replies = rollouts.generate(prompts, _greedy(12, eos))
    assert replies == _hf_greedy(second, prompts, 12, eos) != _hf_greedy(first, prompts, 12, eos)
    assert rollouts.syncs == 2


def test_a_reply_keeps_its_stop_token_and_a_cut_one_has_none(micro_base_dir):
    prompts = _prompts(micro_base_dir)
    policy = _policy(micro_base_dir, seed=1)
    rollouts = _rollouts(micro_base_dir, prompts)
    rollouts.sync(policy, step=0)
    free = rollouts.generate(prompts, _greedy(12, [1_000_000]))  # nothing stops them: cut at the limit
    assert all(len(r) == 12 for r in free)
    stop = free[0][3]  # make the 4th token of the first reply a stop token
    replies = rollouts.generate(prompts, _greedy(12, [stop]))
    assert replies[0] == free[0][:4]


def test_adapter_weights_carry_each_projection_its_rank_and_scaling(micro_base_dir):
    policy = _policy(micro_base_dir, seed=1)
    weights, rank, scaling = adapter_weights(policy)
    layers = policy.base_model.model.config.num_hidden_layers
    assert rank == 4 and scaling == 2.0
    assert set(weights) == {(layer, p) for layer in range(layers) for p in
                            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    a, b = weights[(0, "q_proj")]
    live = policy.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(a, live.lora_A["default"].weight) and torch.equal(b, live.lora_B["default"].weight)
    a.add_(1.0)  # a copy: the trainer's weights are untouched
    assert not torch.equal(a, live.lora_A["default"].weight)


@pytest.mark.parametrize("overrides,reason", [
    ({"lora": LoraSettings(r=4, alpha=8, qlora=True)}, "4-bit"),
    ({"distributed": {"num_processes": 2, "strategy": "fsdp"}}, "FSDP"),
])
def test_policies_the_engine_cannot_hold_exactly_are_named(micro_base_dir, overrides, reason):
    config = GRPOStageConfig(batch_size=8, num_generations=4, **overrides)
    assert reason in why_not_engine(config, _policy(micro_base_dir, seed=1))
    assert why_not_engine(GRPOStageConfig(batch_size=8, num_generations=4), _policy(micro_base_dir, seed=1)) is None


def _tiny(**overrides) -> GRPOStageConfig:
    values = dict(max_steps=2, batch_size=8, num_generations=4, max_completion_length=8, learning_rate=5e-3,
                  save_steps=10, logging_steps=1, lora=LoraSettings(r=4, alpha=8), heldout_curve_prompts=0)
    values.update(overrides)
    return GRPOStageConfig(**values)


def test_the_stage_trains_on_engine_rollouts_and_says_so(micro_base_dir, micro_data_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="training.grpo"):
        result = run_grpo(_tiny(rollout_backend="engine"), micro_base_dir, micro_data_dir, tmp_path / "grpo")
    assert "rollouts sampled by the serving engine" in caplog.text
    rows = [row for row in result.log_history if "reward" in row]
    assert len(rows) == 2 and all(0 < row["completions/mean_length"] <= 8 for row in rows)
    assert (result.output_dir / "model.safetensors").is_file()


def test_asking_for_the_engine_where_it_cannot_hold_the_policy_is_one_clear_error(micro_base_dir, micro_data_dir,
                                                                                   tmp_path):
    config = _tiny(rollout_backend="engine", lora=LoraSettings(r=4, alpha=8, qlora=True))
    with pytest.raises(TrainingError, match="rollout_backend: engine: the base is 4-bit"):
        run_grpo(config, micro_base_dir, micro_data_dir, tmp_path / "grpo")
