"""Fixtures for the evals tests: the shared micro model loaded once, and one full eval run on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from evals.config import EvalConfig
from evals.model import LoadedModel, load_model
from evals.results import EvalResult
from evals.runner import run_evals


@pytest.fixture(scope="session")
def micro_lm(micro_base_dir: Path) -> LoadedModel:
    return load_model(micro_base_dir)


@pytest.fixture(scope="session")
def micro_results(micro_base_dir: Path, micro_data_dir: Path) -> list[EvalResult]:
    """Every suite on the micro model against the micro data dir (the run every pipeline makes)."""
    return run_evals(micro_base_dir, micro_data_dir, EvalConfig())

