"""Evals: suites that score a Hugging Face causal-LM dir on the data stage's held-out files,
typed results, MLflow logging and promotion gates.

The names below load on first use (PEP 562), so the pure parts (``evals.scoring``, the reply contract)
import without torch: the gateway and the CLI's ``--help`` read them without paying for a model stack.
"""

from __future__ import annotations

from artifacts.common.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "evals.config": ["EvalConfig"],
    "evals.errors": ["EvalError"],
    "evals.gates": ["Gate", "GateCheck", "GateReport", "check_gates", "parse_gate"],
    "evals.results": ["EvalResult", "SliceResult", "markdown_table", "metrics_dict", "read_results_json",
                      "results_to_json", "write_results_json"],
    "evals.runner": ["run_evals"],
    "evals.suites": ["SUITES"],
    "evals.suite_names": ["suite_names"],
    "evals.tracking": ["log_results"],
})
