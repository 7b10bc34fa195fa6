"""Run the configured suites on one model dir against one data dir, in-process.

Every input is checked before the model is loaded, so a typo in a path fails in milliseconds with
the path named, not after a model load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from evals.config import EvalConfig
from evals.context import EvalContext
from evals.errors import EvalError
from evals.model import load_model
from evals.results import EvalResult
from evals.suites import SUITES

log = logging.getLogger(__name__)


def run_evals(model_dir: str | Path, data_dir: str | Path, config: EvalConfig | None = None,
              device: str | None = None, adapter: str | Path | None = None) -> list[EvalResult]:
    """Load the model once, run each suite in ``config.suites`` order and return all their results.

    ``device`` overrides the run-time choice (cuda if available, else cpu); ``adapter``: a LoRA adapter evaluated
    on the model, unmerged (evals.model.load_model).
    """
    config = config or EvalConfig()
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    if not model_dir.is_dir():
        raise EvalError(f"{model_dir}: model dir not found")
    if not data_dir.is_dir():
        raise EvalError(f"{data_dir}: data dir not found")
    for name in config.suites:
        for filename in SUITES[name].files:
            if not (data_dir / filename).is_file():
                raise EvalError(f"{data_dir / filename}: data file not found (needed by suite {name!r})")

    lm = load_model(model_dir, device=device, adapter=adapter, generation_backend=config.generation_backend)
    ctx = EvalContext(lm=lm, data_dir=data_dir, config=config)
    prompts = [p for name in config.suites if SUITES[name].prompts for p in SUITES[name].prompts(ctx)]
    if prompts:  # one packed generation pass for every generation suite; they then read the cache
        started = time.perf_counter()
        ctx.generate(prompts, desc="generate")
        log.info("eval generation: %d prompts in %.1fs", len(set(prompts)), time.perf_counter() - started)
    results: list[EvalResult] = []
    for name in config.suites:
        started = time.perf_counter()
        suite_results = SUITES[name].run(ctx)
        log.info("eval suite %s: %s in %.1fs", name,
                 ", ".join(f"{r.metric}={r.value:.4g} (n={r.n})" for r in suite_results),
                 time.perf_counter() - started)
        results.extend(suite_results)
    return results
