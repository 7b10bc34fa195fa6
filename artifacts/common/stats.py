"""Small statistics every report needs, in one place so every table computes a p95 the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float | None:
    """The `q`-quantile (0..1) with linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100), NaN for no values: the form benchmark tables print."""
    value = quantile(values, p / 100)
    return float("nan") if value is None else value
