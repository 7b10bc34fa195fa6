# Set-up-and-go targets. `make run` and `make test` build the virtual environment on first use.
#
# torch is installed FIRST and on its own: an unpinned torch (or a package asking for a newer one)
# pulls a multi-GB CUDA build. CPU machines use the pinned CPU wheel below; a CUDA machine passes
# its own spec, e.g. `make venv TORCH=torch==2.13.0` with pip pointed at the CUDA wheel index.

PYTHON ?= python3
TORCH ?= torch==2.13.0
# the engine's kernels are Triton: CPU CI runs them under triton's interpreter, with the GPU machine's version
TRITON ?= triton==3.6.0
# installs the requirements (pip installs torch itself: it honours this machine's pip configuration and wheels)
UV ?= uv==0.13.9
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= configs/default.yaml
PYTEST_ARGS ?=
# the suite runs on this many workers, a test module to a worker (rollouts judged on latency run beside the
# other worker: their shadow gate compares each mirrored request with the champion's answer of the same moment),
# handed out longest module first (tests/module_order.py; --no-loadscope-reorder keeps that order)
TEST_WORKERS ?= 2

.PHONY: venv run test lint clean-venv

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --no-compile "$(TORCH)"
# the rest through uv, in one resolve: the same versions pip picks (checked with `pip freeze`), downloaded and
# installed in parallel (3 min 17 s -> ~1 min 45 s for `make venv` on 2 cores); pip takes over if uv cannot.
# A CUDA torch brings the triton it was built with; the CPU wheel brings none, and a package that wants any triton
# (xgrammar) would pull the newest, whose interpreter refuses kernels written for the device's 3.6: pin it there
	triton_pin=$$($(BIN)/python -c "import torch; print('' if torch.version.cuda else '$(TRITON)')"); \
	{ $(BIN)/pip install --quiet --no-compile "$(UV)" && \
	  $(BIN)/uv pip install --python $(BIN)/python --native-tls --no-compile -r requirements.txt "$(TORCH)" $$triton_pin; } \
	  || $(BIN)/pip install --no-compile -r requirements.txt "$(TORCH)" $$triton_pin
	$(BIN)/pip install --no-deps -e .
# byte-compile once, on every core, instead of file by file inside pip (`make venv` 5 min 0 s -> 3 min 12 s on
# 2 cores); a few files not meant to compile (torch's py312 samples) fail and are skipped, as pip skips them.
# The packages' own test suites and pip are never imported by ours (97 -> 83 s; a file left out would only be
# compiled when first imported)
	$(BIN)/python -m compileall -q -j 0 -x '/(tests?|pip)/' $(VENV)/lib >/dev/null 2>&1 || true
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(BIN)/lifecycle run $(RECIPE)

test: venv
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV)
