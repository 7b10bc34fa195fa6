"""The GPU device check (benchmarks/gpu_check.sh, benchmarks/gpu_serving.py) dry-run on CPU with the tiny shape.

Device minutes are scarce (one call of about 8 minutes, on a bare machine), so everything the check does runs here
first: the shell script itself (no CUDA tests and no wheels on CPU), every section of the benchmark with sane
numbers in its JSON, a run cut by SIGTERM that still leaves valid JSON with the rows it measured, a short budget
that skips sections with their reasons, and the profiler's event counting on the CUDA event names a GPU run sees.
The C++ CPU kernels are switched off (``LLM_LIFECYCLE_CPU_KERNELS=0``): their first build takes half a minute and
this tests the benchmark, not them. HF's static cache runs uncompiled on CPU (``--hf-compile`` is a GPU default).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_serving.py"
CHECK = REPO / "benchmarks" / "gpu_check.sh"
ALL_SECTIONS = {"facts", "gemv", "model", "engine", "hf", "http", "gptq", "profile"}


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, LLM_LIFECYCLE_CPU_KERNELS="0", TOKENIZERS_PARALLELISM="false", **extra)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict]:
    """gpu_check.sh as the device runs it, on CPU: its files in OUT and the JSON."""
    out = tmp_path_factory.mktemp("gpu-check-out")
    env = _env(OUT=str(out), GPU_CHECK_DEVICE="cpu", GPU_CHECK_PYTEST="0", GPU_CHECK_WHEELS="0",
               GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path_factory.mktemp("gpu-check-work")))
    p = subprocess.run(["bash", str(CHECK), "400"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, json.loads((out / "gpu_serving.json").read_text())


def test_the_check_leaves_a_few_files_and_every_section(dry_run):
    out, data = dry_run
    files = sorted(f.name for f in out.iterdir())
    assert {"check.log", "gpu_serving.log", "gpu_serving.json", "http_server.log"} <= set(files), files
    assert len(files) <= 8 and all((out / f).is_file() for f in files)  # what the device sends back: 8 files
    assert "gpu_serving.py: exit 0" in (out / "check.log").read_text()
    sections = data["sections"]
    assert set(sections) == ALL_SECTIONS and data["interrupted"] is False
    gptq_module = (REPO / "benchmarks" / "gptq_rtn.py").is_file()
    for name, sec in sections.items():
        if name == "gptq" and not gptq_module:
            assert sec["status"] == "error" and "gptq_rtn" in sec["error"]
        else:
            assert sec["status"] == "ok", (name, sec)
    assert data["meta"]["copy_bandwidth_gbs"] > 0 and data["meta"]["floor_ms_per_step"] > 0
    model = sections["model"]["rows"][0]
    assert 0 < model["step_weight_bytes"] < model["weight_bytes"]  # the embedding is not streamed per step


def test_the_gemv_section_times_both_gemms_on_every_projection_shape(dry_run):
    """cuBLAS (F.linear) and the Triton GEMV (interpreted here) on the tiny shape's five projections, both equal to
    the fp32 product, and the sum over one decode step's projections; the 4-bit GEMV on the four a bundle
    quantizes (the default words-per-step only, on CPU)."""
    _, data = dry_run
    rows = {r["projection"]: r for r in data["sections"]["gemv"]["rows"] if "cublas_us" in r}
    int4 = {r["projection"]: r for r in data["sections"]["gemv"]["rows"] if "int4_us" in r}
    assert set(rows) == {"qkv", "o", "gate_up", "down", "lm_head", "one decode step"}
    assert set(int4) == {"qkv", "o", "gate_up", "down"}  # the head stays bf16 in a 4-bit bundle
    assert all(r["int4_us"] > 0 and r["int4_tile_words"] == 2048 for r in int4.values())
    for name, r in rows.items():
        assert r["cublas_us"] > 0 and r["triton_us"] > 0
        if name != "one decode step":
            assert r["cublas_rel_err"] < 1e-5 and r["triton_rel_err"] < 1e-5 and r["cublas_of_copy"] > 0
    assert rows["qkv"]["n"] == 256 and rows["down"]["k"] == 256  # (4 + 2 * 2) heads of 32; intermediate 256


def test_every_variant_and_batch_has_sane_engine_rows(dry_run):
    _, data = dry_run
    plan = data["meta"]["plan"]
    rows = {(r["variant"], r["batch"]): r for r in data["sections"]["engine"]["rows"]}
    # the Triton GEMV's variant runs batch 1 only: more rows stay on cuBLAS
    assert set(rows) == {(v, b) for v in ("ours", "ours-eager", "ours-torch") for b in plan["batches"]} | {
        ("ours-triton-gemv", 1)} | {("ours-sync", b) for b in plan["batches"] if b in (1, 64)}
    assert rows["ours", 1]["async_scheduling"] is True and rows["ours-sync", 1]["async_scheduling"] is False
    for (_, batch), r in rows.items():
        assert r["tokens"] == batch * plan["max_tokens"]
        assert r["total_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_ms_per_step"] > 0
        assert r["steps"] >= plan["max_tokens"] and 0 < r["decode_steps"] < r["steps"]
        assert r["attention_backend"] == "torch" and r["decode_graphs"] is False  # CPU, C++ kernels off
    assert all(r["x_floor"] > 0 for (_, b), r in rows.items() if b == 1)
    assert set(data["summary"]["batch1_x_floor"]) == {"ours", "ours-eager", "ours-torch", "ours-triton-gemv",
                                                      "ours-sync"}


def test_hf_baselines_and_the_ratios_against_them(dry_run):
    _, data = dry_run
    plan = data["meta"]["plan"]
    rows = {(r["variant"], r["batch"]): r for r in data["sections"]["hf"]["rows"]}
    assert set(rows) == {(v, b) for v in ("hf-eager", "hf-static") for b in plan["batches"]}
    assert all(r["total_tok_s"] > 0 and r["tokens"] == r["batch"] * plan["max_tokens"] for r in rows.values())
    assert not any(r["compiled"] for r in rows.values())  # compiling takes minutes on CPU: a GPU default
    ratios = {(r["hf"], r["batch"]): r for r in data["summary"]["ours_over_hf"] if r["ours"] == "ours"}
    assert set(ratios) == set(rows)
    for (variant, batch), r in ratios.items():
        ours = next(e for e in data["sections"]["engine"]["rows"] if e["variant"] == "ours" and e["batch"] == batch)
        assert r["total_tok_s"] == pytest.approx(ours["total_tok_s"] / rows[variant, batch]["total_tok_s"], rel=1e-2)


def test_http_streams_report_latency_tails(dry_run):
    _, data = dry_run
    plan = data["meta"]["plan"]
    (r,) = data["sections"]["http"]["rows"]
    assert r["streams"] == plan["http_streams"] and r["tokens"] == plan["http_requests"] * plan["max_tokens"]
    assert r["output_tok_s"] > 0 and r["tokenizer"] is True
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p95_ms"]
    assert r["engine_steps"] >= plan["max_tokens"] and r["steps_overlapped_share"] == 0  # CPU: async off


def test_profile_counts_ops_per_decode_step_for_each_variant(dry_run):
    _, data = dry_run
    rows = {r["variant"]: r for r in data["sections"]["profile"]["rows"]}
    assert set(rows) == {"ours", "ours-eager", "ours-torch", "ours-triton-gemv", "ours-sync"}
    for r in rows.values():
        assert r["batch"] == data["meta"]["plan"]["profile_batch"] and r["aten_ops_per_step"] > 0
        assert r["launches_per_step"] == 0 and r["host_syncs_per_step"] == 0  # no CUDA calls on CPU


def _event(name: str, start: float, end: float, device: str = "CPU") -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=SimpleNamespace(name=device))


def test_the_profile_counts_cuda_launches_and_syncs_inside_the_steps_only():
    """The GPU names of the counts, on made-up events: two step ranges, calls inside and outside them."""
    from benchmarks.gpu_serving import STEP_MARK, count_step_events

    events = [_event(STEP_MARK, 0, 10), _event(STEP_MARK, 20, 30), _event(STEP_MARK, 0, 10, "CUDA"),
              _event("cudaLaunchKernel", 1, 2), _event("cuLaunchKernelEx", 21, 22), _event("cudaGraphLaunch", 3, 4),
              _event("cudaGraphLaunch", 23, 24), _event("cudaMemcpyAsync", 5, 6), _event("cudaEventSynchronize", 7, 8),
              _event("cudaStreamSynchronize", 25, 26), _event("cudaMemcpy", 27, 28), _event("aten::mm", 2, 3),
              _event("cudaLaunchKernel", 12, 13), _event("cudaDeviceSynchronize", 14, 15),  # between the steps
              _event("gemm_kernel", 2, 3, "CUDA"), _event("Memcpy DtoH", 6, 7, "CUDA")]
    counts = count_step_events(events, steps=2, batch=64)
    assert counts["launches_per_step"] == 1.0 and counts["graph_launches_per_step"] == 1.0
    assert counts["host_syncs_per_step"] == 1.5  # event sync, stream sync, blocking memcpy; not the async copy
    assert counts["aten_ops_per_step"] == 0.5 and counts["gpu_events_per_step"] == 1.5  # the GPU-side mark too
    assert counts["cuda_calls_per_step"]["cudaMemcpyAsync"] == 0.5 and "cudaDeviceSynchronize" not in \
        counts["cuda_calls_per_step"]
    with pytest.raises(RuntimeError, match="step ranges"):
        count_step_events(events, steps=3, batch=64)


def test_a_run_cut_by_sigterm_keeps_every_row_it_measured(tmp_path):
    """The device's timeout: SIGTERM after the first engine row, and the JSON is still valid, says it was cut,
    and holds that row."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--out", str(out),
                          "--work", str(tmp_path / "work"), "--sections", "engine", "hf",
                          "--batches", "1", "2", "3", "4", "--max-tokens", "32", "--budget-s", "300"],
                         cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = out / "gpu_serving.json"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            if path.is_file() and json.loads(path.read_text())["sections"].get("engine", {}).get("rows"):
                break
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()[0][-3000:]
        p.send_signal(signal.SIGTERM)
        log = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, log[-3000:]
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and data["sections"]["model"]["status"] == "ok"
    rows = data["sections"]["engine"]["rows"]
    assert rows and rows[0]["variant"] == "ours" and rows[0]["batch"] == 1
    assert "hf" not in data["sections"] or data["sections"]["hf"]["status"] != "ok"
    assert not list(out.glob("*.tmp"))


def test_a_short_budget_skips_sections_with_their_reasons(tmp_path):
    """In this process (nothing heavy runs): the model cannot be paid for, so every section after it says why."""
    from benchmarks.gpu_serving import main

    before = signal.getsignal(signal.SIGTERM)
    assert main(["--device", "cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--budget-s", "3"]) == 0
    assert signal.getsignal(signal.SIGTERM) == before  # main puts back the handler it replaced
    sections = json.loads((tmp_path / "gpu_serving.json").read_text())["sections"]
    assert sections["model"]["status"] == "skipped" and "budget" in sections["model"]["reason"]
    for name in ("engine", "hf", "http", "gptq", "profile"):
        assert sections[name]["status"] == "skipped" and "no model" in sections[name]["reason"], name
