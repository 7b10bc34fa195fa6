"""A deliberate crash point for the kill -9 drills: ``LIFECYCLE_ROLLOUT_CRASH_AT=after-alias:champion`` makes
the controller die (exit 137, as if SIGKILLed) right after that alias moved and before anything recorded it,
the worst instant for a restart. Unset, it does nothing."""

from __future__ import annotations

import os

ENV = "LIFECYCLE_ROLLOUT_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os._exit(137)
