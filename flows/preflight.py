"""Checks that can fail in milliseconds, run before Prefect starts and before any stage trains.

A recipe that names a directory that is not a model, or a local dataset without the columns its stage
needs, must fail before the pipeline spends minutes on a base model or an earlier stage.
"""

from __future__ import annotations

from flows.recipe import Recipe


def preflight(recipe: Recipe) -> None:
    """Raise the stage's own LifecycleError for the first input that cannot work."""
    if not recipe.base.is_embedded:
        from pathlib import Path

        from training.base_model import validate_model_dir

        validate_model_dir(Path(recipe.base.source))
    data = recipe.data
    local = {"sft": data.sft_path, "preference": data.preference_path, "grpo": data.grpo_path}
    if any(local.values()):
        from datasets.utils.logging import disable_progress_bar, enable_progress_bar

        from training.loaders import load_local_dataset

        disable_progress_bar()  # a check, not work: its answer is the error line or nothing
        try:
            for kind, path in local.items():
                if path:
                    load_local_dataset(path, kind)
        finally:
            enable_progress_bar()
