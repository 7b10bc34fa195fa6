#!/usr/bin/env bash
# The one device command of issue 34: everything the GPU machine is lent for, in one call of at most ~8 minutes.
#
# The machine starts bare (no registry) and every minute on it counts, so this script does all of the work and the
# command line stays short: it installs the carried server wheels (.whl/, when present), prints the device facts,
# runs the CUDA tests (tests/serving/test_cuda.py, named: collecting other modules there fails without fastapi),
# then benchmarks/gpu_serving.py with what is left of the budget. Everything lands in $OUT (default ./out), in five
# files at most: check.log, pytest.log, gpu_serving.log, gpu_serving.json (rewritten after every row, so a timeout
# still returns what was measured) and http_server.log.
#
#   bash benchmarks/gpu_check.sh [TOTAL_SECONDS]          # default 420: the budget of the whole script
#
# Environment (all optional): GPU_CHECK_DEVICE (cuda; cpu for the dry run), GPU_CHECK_PYTEST=0 (skip the CUDA
# tests), GPU_CHECK_PYTEST_S (their limit, default 180), GPU_CHECK_WHEELS=0 (skip the wheel install),
# GPU_CHECK_SITE (where the wheels go, default /tmp/site), GPU_CHECK_PYTHON (default python3), GPU_CHECK_WORK (the
# model dirs, default /tmp/gpu-check-work, removed at the end), GPU_CHECK_ARGS (more gpu_serving.py flags, e.g.
# "--sections facts engine hf").
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-./out}
mkdir -p "$OUT"
TOTAL_S=${1:-420}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${GPU_CHECK_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check-work}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/check.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

say "== gpu_check: budget ${TOTAL_S}s, device $DEVICE, $(date -u +%FT%TZ)"
if [ "${GPU_CHECK_WHEELS:-1}" != 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
        say "wheels: $(ls .whl | wc -l) installed into $SITE"
    else
        say "wheels: install FAILED (see above); the HTTP section will say what is missing"
    fi
fi

say "== facts"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 \
        | tee -a "$LOG"
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, sys
import torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", "capability",
          torch.cuda.get_device_capability(0), "SMs", p.multi_processor_count)
try:
    import serving.api.server  # noqa: F401 - the HTTP section's imports: fastapi, uvicorn, pydantic
    print("serving.api.server: importable")
except Exception as e:  # noqa: BLE001
    print("serving.api.server: NOT importable:", type(e).__name__, e)
EOF

if [ "${GPU_CHECK_PYTEST:-1}" != 0 ]; then
    say "== pytest -m cuda tests/serving/test_cuda.py (limit ${GPU_CHECK_PYTEST_S:-180}s)"
    # -v: each test's verdict is written as it ends, so a run cut by the limit still says which passed
    timeout -s TERM -k 15 "${GPU_CHECK_PYTEST_S:-180}" "$PY" -m pytest -v -m cuda -p no:cacheprovider \
        --timeout 120 tests/serving/test_cuda.py >"$OUT/pytest.log" 2>&1
    say "pytest: exit $? after ${SECONDS}s of the check; last lines:"
    tail -n 5 "$OUT/pytest.log" | tee -a "$LOG"
fi

LEFT=$((TOTAL_S - SECONDS - 15))
if [ "$LEFT" -lt 30 ]; then
    say "== gpu_serving.py: not run, ${LEFT}s left"
    exit 0
fi
say "== gpu_serving.py --budget-s $LEFT (started at ${SECONDS}s)"
rm -rf "$WORK"
# shellcheck disable=SC2086 - GPU_CHECK_ARGS is a list of flags
timeout -s TERM -k 20 $((LEFT + 30)) "$PY" benchmarks/gpu_serving.py --device "$DEVICE" --out "$OUT" \
    --work "$WORK" --budget-s "$LEFT" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_serving.log"
say "gpu_serving.py: exit ${PIPESTATUS[0]} at ${SECONDS}s"
if [ -f "$WORK/http_server.pid" ]; then  # the server runs in its own session: stop what gpu_serving.py could not
    kill -TERM -- "-$(cat "$WORK/http_server.pid")" 2>/dev/null && say "stopped a leftover server"
fi
rm -rf "$WORK"
