"""The recipe's optional `draft:` section: it maps 1:1 to DraftConfig, refuses unknown keys and bad values with the
file and key, the preflight refuses a draft that keeps every layer, and the report says how to serve with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.errors import ConfigError
from flows.preflight import preflight
from flows.recipe import load_recipe
from flows.report import draft_note
from flows.stage_runner import StageOutput
from training.draft_config import DraftConfig

MICRO = "name: x\nbase:\n  source: embedded\n  embedded: {preset: micro}\nquantize: null\n"


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(MICRO + text)
    return path


def test_the_draft_section_is_optional_and_maps_to_draft_config(tmp_path):
    assert load_recipe(_recipe(tmp_path, "")).draft is None
    assert load_recipe(_recipe(tmp_path, "draft:\n")).draft is None  # null: off, as for quantize
    assert load_recipe(_recipe(tmp_path, "draft: {}\n")).draft == DraftConfig()
    recipe = load_recipe(_recipe(tmp_path, "draft:\n  layers: 1\n  steps: 50\n  temperature: 2\n"))
    assert recipe.draft == DraftConfig(layers=1, steps=50, temperature=2.0)
    preflight(recipe, "r.yaml")  # 1 of the micro model's 2 layers: fine


@pytest.mark.parametrize(("text", "expected"), [
    ("draft:\n  layer: 1\n",
     "unknown key 'draft.layer' (known keys: batch_size, device, distributed, eval_tokens, layers,"),
    ("draft:\n  layers: 0\n", "draft: layers: must be >= 1, got 0"),
    ("draft:\n  steps: many\n", "draft.steps: expected an integer, got 'many'"),
])
def test_a_bad_draft_section_names_the_file_and_key(tmp_path, text, expected):
    path = _recipe(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value), str(info.value)


def test_preflight_refuses_a_draft_as_deep_as_the_model(tmp_path):
    path = _recipe(tmp_path, "draft: {layers: 2}\n")
    with pytest.raises(ConfigError, match="r.yaml: draft.layers: 2 keeps all of the model's 2 decoder layers"):
        preflight(load_recipe(path), path)
    path = _recipe(tmp_path, "draft: {seq_len: 512}\n")
    with pytest.raises(ConfigError, match=r"draft.seq_len: 512 exceeds the model's context"):
        preflight(load_recipe(path), path)


def test_the_report_note_is_the_serve_command():
    draft = StageOutput(stage="draft", key="k", path="/w/runs/x/draft-k/draft",
                        metrics={"agreement_before": 0.612, "agreement_after": 0.871},
                        info={"target": "/w/runs/x/grpo-k/stage/merged", "layers": "1 of 4"})
    shipped = StageOutput(stage="release-gptq", key="r", path="/w/runs/x/bundle-gptq-k/bundle")
    note = draft_note(draft, shipped)
    assert "1 of 4 layers" in note and "0.61 → 0.87" in note
    assert note.endswith("`lifecycle serve /w/runs/x/bundle-gptq-k/bundle --speculative-tokens 4 "
                         "--speculative-model /w/runs/x/draft-k/draft`")
    assert "lifecycle serve /w/runs/x/grpo-k/stage/merged " in draft_note(draft, None)
