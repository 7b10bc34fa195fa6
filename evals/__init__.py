"""Evals: suites that score a Hugging Face causal-LM dir on the data stage's held-out files,
typed results, MLflow logging and promotion gates."""

from evals.config import EvalConfig
from evals.errors import EvalError
from evals.gates import Gate, GateCheck, GateReport, check_gates, parse_gate
from evals.results import (
    EvalResult,
    SliceResult,
    markdown_table,
    metrics_dict,
    read_results_json,
    results_to_json,
    write_results_json,
)
from evals.runner import run_evals
from evals.suites import SUITES, suite_names
from evals.tracking import log_results

__all__ = [
    "SUITES",
    "EvalConfig",
    "EvalError",
    "EvalResult",
    "Gate",
    "GateCheck",
    "GateReport",
    "SliceResult",
    "check_gates",
    "log_results",
    "markdown_table",
    "metrics_dict",
    "parse_gate",
    "read_results_json",
    "results_to_json",
    "run_evals",
    "suite_names",
    "write_results_json",
]
