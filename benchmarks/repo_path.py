"""Imported first by a benchmark run as a file (``python benchmarks/NAME.py``), before any project import.

Python puts the script's folder first on ``sys.path``, and benchmarks/ holds ``serving.py``, which would then
stand for the project's ``serving`` package. This takes benchmarks/ off the path and puts the repository root
first, so ``serving`` is the package and ``benchmarks.x`` imports work. A benchmark imported as a module
(``benchmarks.gateway``, from a test or another benchmark) does not need it: its importer set the path up.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
