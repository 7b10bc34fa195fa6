"""EvalConfig validation (YAML maps 1:1 onto it, so bad values must name the field)."""

from __future__ import annotations

import pytest

from evals.config import EvalConfig
from evals.suites import suite_names


def test_defaults_run_every_suite():
    config = EvalConfig()
    assert config.suites == suite_names()
    assert set(suite_names()) == {"task_accuracy", "sampled_task_accuracy", "format_adherence", "safety",
                                  "perplexity", "preference_accuracy", "structured"}
    config.suites.append("x")  # the default list is not shared between instances
    assert EvalConfig().suites == suite_names()


def test_unknown_suite_is_named_with_the_known_ones():
    with pytest.raises(ValueError) as info:
        EvalConfig(suites=["task_accuracy", "vibes"])
    message = str(info.value)
    assert message.startswith("suites:") and "'vibes'" in message
    assert all(name in message for name in suite_names())


@pytest.mark.parametrize("kwargs, field", [
    ({"suites": []}, "suites"), ({"suites": "safety"}, "suites"),
    ({"suites": ["safety", "safety"]}, "suites"),
    ({"max_examples": 0}, "max_examples"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"batch_size": 0}, "batch_size"), ({"samples_per_prompt": 0}, "samples_per_prompt"),
    ({"sample_temperature": 0.0}, "sample_temperature"), ({"sample_temperature": -1}, "sample_temperature"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EvalConfig(**kwargs)


def test_the_light_name_list_matches_the_suite_registry():
    # EvalConfig validates against evals.suite_names (no torch); the registry must hold exactly those suites.
    from evals.suite_names import SUITE_NAMES
    from evals.suites import SUITES

    assert tuple(SUITES) == SUITE_NAMES
