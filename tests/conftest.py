"""Session-wide fixtures shared by every package's tests.

`micro_base_dir` is a real (microscopic) embedded base model trained in seconds, and `micro_data_dir` a
real data-stage output with small counts: later stages test against them instead of mocks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest
import torch

from tests import module_order

if not torch.cuda.is_available():
    # the engine's Triton kernels run on CPU tensors under triton's interpreter, which triton reads when a kernel
    # is decorated: set before any test module (or a library such as bitsandbytes) first imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)  # the tests share two cores with each other's servers: one thread each is fairer


def pytest_addoption(parser: pytest.Parser) -> None:
    module_order.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    module_order.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules longest first (the order xdist hands them out: see module_order.py). Tests marked ``cuda`` run only
    where torch sees a CUDA device: CPU CI reports them skipped, with why."""
    module_order.longest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory) -> Iterator[str]:
    """This test process's Prefect server, started the first time a module asks for it (see prefect_server.py)."""
    from tests.prefect_server import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect_server")) as api:
        yield api


@pytest.fixture(scope="module")
def on_prefect_server(prefect_api_url: str) -> Iterator[str]:
    """For one module (``pytestmark = pytest.mark.usefixtures("on_prefect_server")``): the commands it starts run
    their flows on the shared server instead of each starting an ephemeral one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_URL", prefect_api_url)
        yield prefect_api_url


@pytest.fixture(scope="session")
def base_model_cache(tmp_path_factory) -> Path:
    """One cache root per test session, so cache hits inside a session are real and sessions are hermetic."""
    return tmp_path_factory.mktemp("base_models")


@pytest.fixture(scope="session")
def micro_base_dir(base_model_cache: Path) -> Path:
    """A Hugging Face dir of the embedded `micro` preset (tiny Llama + chat tokenizer), built once."""
    from training.base_model import BaseModelConfig, build_base_model

    return build_base_model(BaseModelConfig(preset="micro"), base_model_cache)


@pytest.fixture(scope="session")
def micro_data_dir(tmp_path_factory) -> Path:
    """`build_datasets` output with `training.data.micro_data_config()`: every contract file, small counts."""
    from training.data import build_datasets, micro_data_config

    out = tmp_path_factory.mktemp("micro_data") / "data"
    build_datasets(micro_data_config(), out)
    return out


@pytest.fixture(scope="session")
def real_quantized_dirs(tmp_path_factory) -> dict[str, Path]:
    """Real gptqmodel GPTQ and AWQ checkpoints of a tiny Llama, made by the project's quantize package.

    hidden 128 with 2 KV heads of 32 dims keeps every out-feature a multiple of 64 (AWQ's clip search);
    group size 32 divides every in-feature. Takes ~20-40 s on a busy 2-core machine. Here, not in tests/artifacts,
    so the serving tests that read the same bundles share this session's pair instead of quantizing again."""
    import json

    from transformers import AutoTokenizer

    from quantize.awq import quantize_awq
    from quantize.calibration import build_calibration_set
    from quantize.config import QuantizeConfig
    from quantize.gptq import quantize_gptq
    from tests.artifacts.conftest import CORPUS, build_tiny_llama

    root = tmp_path_factory.mktemp("quantized")
    source = build_tiny_llama(root / "fp", hidden_size=128, intermediate_size=256)
    (root / "calibration.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    calibration = build_calibration_set(root / "calibration.jsonl", AutoTokenizer.from_pretrained(str(source)),
                                        num_samples=8, seq_len=64)
    config = QuantizeConfig(bits=4, group_size=32, calibration_samples=8, calibration_seq_len=64)
    dirs = {"gptq": quantize_gptq(source, root / "gptq", calibration, config),
            "awq": quantize_awq(source, root / "awq", calibration, config)}
    (root / "calibration_digest").write_text(calibration.digest)
    return dirs
