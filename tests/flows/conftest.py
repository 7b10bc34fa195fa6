"""The shipped smoke recipe (configs/smoke.yaml), pointed at a temporary workdir."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

SMOKE_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


@pytest.fixture()
def micro_recipe(tmp_path: Path) -> Path:
    """configs/smoke.yaml with its own workdir, written into a temp dir; returns its path."""
    recipe = yaml.safe_load(SMOKE_RECIPE.read_text())
    recipe.update(name="micro-e2e", workdir=str(tmp_path / "workdir"))
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
