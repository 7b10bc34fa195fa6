"""Rollouts: a candidate moved from shadow to champion by gates, decisions recorded in the MLflow registry.

The doors (imported on first use, so ``serving.rollout.state`` and friends stay light): ``start_rollout``
and ``install_on_fleet`` put a version on a fleet (``start.py``); ``Controller`` drives a persisted rollout
(``controller.py``); ``RegistryConsole`` reads and moves the aliases a person sees (``registry_console.py``).
"""

from artifacts.common.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "serving.rollout.start": ["install_on_fleet", "start_rollout"],
    "serving.rollout.controller": ["Controller"],
    "serving.rollout.registry_console": ["RegistryConsole"],
})
