"""Evals: suites that score a Hugging Face causal-LM dir on the data stage's held-out files,
typed results, MLflow logging and promotion gates.

The names below load on first use (PEP 562), so the pure parts (``evals.scoring``, the reply contract)
import without torch: the gateway and the CLI's ``--help`` read them without paying for a model stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EvalConfig": "evals.config",
    "EvalError": "evals.errors",
    "Gate": "evals.gates",
    "GateCheck": "evals.gates",
    "GateReport": "evals.gates",
    "check_gates": "evals.gates",
    "parse_gate": "evals.gates",
    "EvalResult": "evals.results",
    "SliceResult": "evals.results",
    "markdown_table": "evals.results",
    "metrics_dict": "evals.results",
    "read_results_json": "evals.results",
    "results_to_json": "evals.results",
    "write_results_json": "evals.results",
    "run_evals": "evals.runner",
    "SUITES": "evals.suites",
    "suite_names": "evals.suite_names",
    "log_results": "evals.tracking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'evals' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
