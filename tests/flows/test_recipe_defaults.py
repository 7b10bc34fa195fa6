"""The training stages' defaults against the tuned recipe: the values that decide whether a stage helps are the
tuned ones where one value fits (DPO's learning rate and NLL weight), and a recipe that leaves such a key out is
told which default it gets (`untuned_keys`, printed by `lifecycle run` as warning lines)."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.recipe import load_recipe, untuned_keys
from training.stage_config import KEYS_THAT_MATTER, DPOStageConfig, GRPOStageConfig, SFTStageConfig

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "configs" / "default.yaml"


def test_dpo_defaults_are_the_tuned_values_not_the_one_that_erased_refusals():
    tuned = yaml.safe_load(DEFAULT.read_text())["training"]["dpo"]
    assert DPOStageConfig().learning_rate == tuned["learning_rate"] != 5e-4
    assert DPOStageConfig().sft_weight == tuned["sft_weight"]
    assert DPOStageConfig().pairs == tuned["pairs"] == "on_policy"


def test_grpo_defaults_are_the_tuned_schedule_and_prompt_filter():
    tuned = yaml.safe_load(DEFAULT.read_text())["training"]["grpo"]
    for key in ("learning_rate", "lr_scheduler", "warmup_ratio", "solved_prompt_draws", "sft_replay_weight"):
        assert getattr(GRPOStageConfig(), key) == tuned[key], key


def test_every_key_that_matters_is_set_by_the_shipped_recipes():
    for name in ("default.yaml", "drill-broken-refusals.yaml", "smoke.yaml", "smoke-distributed.yaml",
                 "local-model.example.yaml"):
        assert untuned_keys(REPO / "configs" / name) == [], name
    sections = yaml.safe_load(DEFAULT.read_text())["training"]
    assert all(set(keys) <= set(sections[stage]) for stage, keys in KEYS_THAT_MATTER.items())


def test_a_recipe_that_leaves_them_out_is_told_which_defaults_apply(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\ntraining:\n  sft: {learning_rate: 1.0e-4}\n  grpo: {enabled: false}\n")
    load_recipe(recipe)  # still a valid recipe: a warning, not an error
    lines = untuned_keys(recipe)
    assert len(lines) == 2  # sft and dpo; grpo is off
    sft, dpo = lines
    steps = SFTStageConfig().max_steps
    assert sft == (f"{recipe}: training.sft: max_steps not set, so the defaults (max_steps={steps}) apply; set them "
                   "for your model (configs/default.yaml has the values tuned for the embedded base)")
    assert dpo.startswith(f"{recipe}: training.dpo: learning_rate, max_steps, beta, sft_weight not set")
    assert "learning_rate=0.0001" in dpo and "sft_weight=1.0" in dpo
    assert GRPOStageConfig().temperature  # the grpo keys exist, they were skipped because the stage is off
