"""Which token ids end a reply, read the same way by training, evals and the server.

A chat model often stops on an end-of-turn id that only ``generation_config.json`` names (as an int or a
list), while its tokenizer knows a different eos token. GRPO's rollouts, the eval suites and the serving
engine must agree on this, or a reply scored in training and in evals ends somewhere else when served.
The answer is the union: every id ``generation_config.json`` lists, then the tokenizer's eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from artifacts.errors import LifecycleError

__all__ = ["stop_token_ids"]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise TypeError(f"expected an int or a list of ints, got {value!r}")
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"expected an int or a list of ints, got {value!r}")
    return values


def stop_token_ids(model_dir: str | Path, tokenizer: Any = None) -> list[int]:
    """``eos_token_id`` of ``model_dir/generation_config.json`` plus the tokenizer's eos id, in that order."""
    ids: list[int] = []
    config = Path(model_dir) / "generation_config.json"
    if config.is_file():
        try:
            ids = _as_ids(json.loads(config.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, TypeError, AttributeError) as exc:
            raise LifecycleError(f"{config}: unreadable eos_token_id ({exc})") from exc
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int):
        ids.append(tokenizer_eos)
    return list(dict.fromkeys(ids))
