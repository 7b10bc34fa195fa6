"""The base model the package ships: it matches its digests, it is the one `make run`'s recipe asks for, it loads,
it leaves the stages something to teach, and a changed copy is refused by name (issue 30, item 1)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from flows.recipe import load_recipe
from training.base_model import BaseModelConfig, ensure_base_model, shipped_checkpoint
from training.greedy_accuracy import greedy_accuracy
from training.ship_base import embedded_config, ship
from training.ship_base import main as ship_main
from training.shipped_base import (
    DIGESTS_FILE,
    SHIPPED_DIR,
    WEIGHTS_FILE,
    ShippedBaseError,
    load_shipped,
    shipped_for,
    verify_files,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = REPO / "configs" / "default.yaml"


@pytest.fixture(scope="module")
def default_base_config() -> BaseModelConfig:
    return load_recipe(DEFAULT_RECIPE).base.embedded


def test_the_shipped_base_matches_its_digests_and_is_the_one_the_main_recipe_asks_for(default_base_config):
    shipped = load_shipped()
    assert shipped is not None, f"no {DIGESTS_FILE} in {SHIPPED_DIR}"
    verify_files(shipped.path, shipped.files)
    assert {WEIGHTS_FILE, "config.json", "tokenizer.json", "tokenizer_config.json", "recipe.json"} <= set(shipped.files)
    # a change to the corpus, the preset or RECIPE_VERSION changes the digest: rebuild with training.ship_base
    assert shipped.recipe_digest == default_base_config.digest(), "the shipped base is stale: run " \
        "`python -m training.ship_base configs/default.yaml` and commit training/embedded_base"
    recipe = json.loads((shipped.path / "recipe.json").read_text())
    assert recipe["digest"] == shipped.recipe_digest
    assert shipped.built["host_cpu"] and shipped.built["torch"]
    assert shipped_checkpoint(default_base_config) == shipped
    assert shipped_checkpoint(dataclasses.replace(default_base_config, shipped=False)) is None
    assert shipped_for(BaseModelConfig(preset="micro").digest()) is None


def test_the_shipped_base_loads_and_leaves_the_stages_something_to_teach():
    from transformers import AutoModelForCausalLM

    from serving.engine.llama_checkpoint import load_plain, plain_reason

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR)
    assert model.config.model_type == "llama" and sum(p.numel() for p in model.parameters()) > 2_000_000
    assert plain_reason(SHIPPED_DIR) is None  # the server's own loader reads it too
    assert load_plain(SHIPPED_DIR, torch.float32, torch.device("cpu")) is not None
    accuracy = greedy_accuracy(SHIPPED_DIR, "addition", n=200)
    assert accuracy.accuracy <= 0.2, f"the base already answers {accuracy.accuracy:.3f} of held-out sums"


def test_the_pipeline_installs_the_shipped_base_instead_of_pretraining(tmp_path, default_base_config):
    start = time.perf_counter()
    first = ensure_base_model(default_base_config, tmp_path)
    assert first.origin == "shipped" and not first.cached
    assert time.perf_counter() - start < 60  # a copy and its sha256s, not 8 minutes of pretraining
    shipped = load_shipped()
    verify_files(first.path, shipped.files)
    again = ensure_base_model(default_base_config, tmp_path)
    assert again.cached and again.path == first.path

    # a copy changed after install is refused by name, not served
    with (first.path / WEIGHTS_FILE).open("r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\0\0\0\1")
    with pytest.raises(ShippedBaseError, match=rf"{WEIGHTS_FILE}: sha256 .* is not the shipped"):
        ensure_base_model(default_base_config, tmp_path)


def test_ship_writes_a_checkpoint_with_digests_and_refuses_another_recipes_model(tmp_path, micro_base_dir):
    micro = BaseModelConfig(preset="micro")
    shipped = ship(micro, tmp_path / "ship", source=micro_base_dir)
    assert load_shipped(tmp_path / "ship") == shipped
    assert shipped.recipe_digest == micro.digest()
    verify_files(tmp_path / "ship", shipped.files)
    assert shipped.files[WEIGHTS_FILE] == load_shipped(tmp_path / "ship").weights_sha256

    other = dataclasses.replace(micro, seed=1)
    with pytest.raises(Exception, match="recipe digest .* is not this recipe's"):
        ship(other, tmp_path / "ship2", source=micro_base_dir)
    assert not (tmp_path / "ship2").exists()

    recipe = tmp_path / "micro.yaml"
    recipe.write_text("name: m\nbase: {source: embedded, embedded: {preset: micro, seed: 1}}\n")
    assert ship_main([str(recipe), "--from", str(micro_base_dir), "--into", str(tmp_path / "ship3")]) == 2
    assert not (tmp_path / "ship3").exists()
    assert embedded_config(DEFAULT_RECIPE) == load_recipe(DEFAULT_RECIPE).base.embedded  # the CLI reads what runs
    recipe.write_text("name: m\nbase: {source: /some/model}\n")
    assert ship_main([str(recipe), "--into", str(tmp_path / "ship4")]) == 2


def test_a_missing_shipped_file_is_named(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(SHIPPED_DIR, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ShippedBaseError, match=r"tokenizer.json: missing"):
        verify_files(copy, load_shipped(copy).files)
