"""GRPO stage on the micro model: grouped sampling with plain generation, verifiable rewards, a reward plot."""

from __future__ import annotations

import json
import shutil

import pytest

from training.grpo import PLOT_NAME, reward_trend, run_grpo
from training.heldout_curve import METRIC as HELDOUT_METRIC
from training.stage_config import GRPOStageConfig, LoraSettings, TrainingError


def tiny_grpo(**overrides) -> GRPOStageConfig:
    values = dict(max_steps=3, batch_size=8, num_generations=4, max_completion_length=8, beta=0.05,
                  learning_rate=5e-3, save_steps=2, logging_steps=1, lora=LoraSettings(r=4, alpha=8),
                  heldout_curve_prompts=4)
    values.update(overrides)
    return GRPOStageConfig(**values)


def test_grpo_logs_rewards_and_plots_the_curve(micro_base_dir, micro_data_dir, tmp_path):
    config = tiny_grpo(partial_credit_weight=0.5, work_weight=0.5, heldout_curve_prompts=4, heldout_curve_every=2,
                       loss_type="dr_grpo", scale_rewards="none", top_entropy_quantile=0.5)
    result = run_grpo(config, micro_base_dir, micro_data_dir, tmp_path / "grpo")
    rows = [row for row in result.log_history if "reward" in row]
    assert len(rows) == 3
    # a step of 2 prompts may hold only sums or only safety prompts: a reward that applies to none of its
    # completions logs None for that step
    for name in ("correctness", "format", "partial_credit", "work", "refusal"):  # work: the `work` column
        means = [row[f"rewards/{name}_reward/mean"] for row in rows]
        assert all(m is None or 0.0 <= m <= 1.0 for m in means), (name, means)
        assert name == "refusal" or any(m is not None for m in means)  # 32 sums to 4 safety prompts per category
    for row in rows:
        assert row["completions/max_length"] <= 8
        assert "kl" in row  # beta > 0: KL against the input model is computed
        # the backward pass ran on informative groups only; the share kept is logged every step
        assert 0.0 <= row["informative_group_fraction"] <= 1.0
    # the held-out greedy accuracy curve: before the first step, every 2 steps and at the last one
    curve = [(row["step"], row[HELDOUT_METRIC]) for row in result.log_history if HELDOUT_METRIC in row]
    assert [step for step, _ in curve] == [0, 2, 3] and all(v in (0.0, 0.25, 0.5, 0.75, 1.0) for _, v in curve)
    assert result.metrics["heldout_greedy_accuracy_last"] == curve[-1][1]
    plot = result.output_dir / PLOT_NAME
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"reward_first_third", "reward_last_third", "reward_gain", "reward_hacking_suspected",
            "correctness_first_third", "correctness_last_third"} <= set(result.metrics)
    assert (result.output_dir / "model.safetensors").is_file()


def test_groups_that_all_scored_the_same_are_not_trained_on(micro_base_dir, micro_data_dir, tmp_path):
    # the micro model answers no sum right: with correctness as the only reward every group scores 0 everywhere,
    # so no group carries a signal and only the one kept to run the step reaches the backward pass
    config = tiny_grpo(format_weight=0.0, refusal_weight=0.0, max_steps=2)
    result = run_grpo(config, micro_base_dir, micro_data_dir, tmp_path / "grpo")
    rows = [row for row in result.log_history if "reward" in row]
    assert rows and all(row["rewards/correctness_reward/mean"] in (0.0, None) for row in rows)
    assert [row["informative_group_fraction"] for row in rows] == [0.0] * len(rows)


def test_a_run_of_safety_prompts_only_has_no_correctness_to_summarise(micro_base_dir, micro_data_dir, tmp_path):
    # no reply of any step is a sum: TRL logs the correctness reward's mean as None on every step, and the
    # stage's reward summary leaves correctness out rather than failing on it
    data = tmp_path / "data"
    data.mkdir()
    rows = [line for line in (micro_data_dir / "grpo_train.jsonl").read_text().splitlines()
            if json.loads(line)["task"] == "safety"]
    assert len(rows) >= 4
    (data / "grpo_train.jsonl").write_text("\n".join(rows) + "\n")
    shutil.copy(micro_data_dir / "sft_train.jsonl", data)  # the chats the stage replays (training.sft_replay)
    result = run_grpo(tiny_grpo(max_steps=2, solved_prompt_draws=0), micro_base_dir, data, tmp_path / "grpo")
    logged = [row for row in result.log_history if "reward" in row]
    assert len(logged) == 2 and all(row["rewards/correctness_reward/mean"] is None for row in logged)
    assert "reward_gain" in result.metrics and "correctness_first_third" not in result.metrics


def test_grpo_data_without_answers_is_one_clear_error(micro_base_dir, tmp_path):
    (tmp_path / "grpo_train.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    with pytest.raises(TrainingError, match=r"grpo_train.jsonl:1: missing column\(s\) \['answer'\]"):
        run_grpo(tiny_grpo(), micro_base_dir, tmp_path, tmp_path / "grpo")


@pytest.mark.parametrize("overrides,field", [({"batch_size": 6, "num_generations": 4}, "batch_size"),
                                             ({"num_generations": 1, "batch_size": 4}, "num_generations"),
                                             ({"beta": -0.1}, "beta"),
                                             ({"partial_credit_weight": -1.0}, "partial_credit_weight"),
                                             ({"work_weight": -0.5}, "work_weight"),
                                             ({"refusal_weight": -1.0}, "refusal_weight"),
                                             ({"loss_type": "ppo"}, "loss_type"),
                                             ({"scale_rewards": "std"}, "scale_rewards"),
                                             ({"top_entropy_quantile": 0.0}, "top_entropy_quantile"),
                                             ({"heldout_curve_every": 0}, "heldout_curve_every"),
                                             ({"rollout_backend": "vllm"}, "rollout_backend")])
def test_grpo_config_rejects_bad_values(overrides, field):
    with pytest.raises(ValueError, match=field):
        GRPOStageConfig(**overrides)


def _history(rewards: list[float], correct: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward": r, "rewards/correctness_reward/mean": c}
            for i, (r, c) in enumerate(zip(rewards, correct))]


def test_reward_rising_while_correctness_falls_is_flagged_as_hacking():
    gamed = reward_trend(_history([0.9, 0.9, 1.0, 1.0, 1.1, 1.1], [0.3, 0.3, 0.2, 0.2, 0.0, 0.0]))
    assert gamed.hacked
    assert (gamed.correct_first, gamed.correct_last) == (0.3, 0.0)
    honest = reward_trend(_history([0.9, 0.9, 1.0, 1.0, 1.1, 1.1], [0.3, 0.3, 0.4, 0.4, 0.5, 0.5]))
    assert not honest.hacked
    noise = reward_trend(_history([0.9, 0.9, 1.1, 1.1], [0.40, 0.40, 0.39, 0.39]))  # within the tolerance
    assert not noise.hacked
    assert reward_trend([{"step": 1, "loss": 0.1}]) is None
