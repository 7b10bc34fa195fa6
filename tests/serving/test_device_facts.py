"""`--dtype auto` from planted device facts: every branch of the decision, no GPU needed."""

from __future__ import annotations

import pytest
import torch

from serving.engine.device_facts import DeviceFacts, auto_dtype, probe, resolve_dtype
from serving.engine.errors import ModelLoadError

CPU = DeviceFacts("cpu")
H100 = DeviceFacts("cuda", (9, 0), True, "NVIDIA H100 80GB HBM3")
A100 = DeviceFacts("cuda", (8, 0), True, "NVIDIA A100-SXM4-80GB")
T4 = DeviceFacts("cuda", (7, 5), False, "Tesla T4")
V100 = DeviceFacts("cuda", (7, 0), False, "Tesla V100-SXM2-32GB")


@pytest.mark.parametrize(("facts", "dtype"), [(CPU, "float32"), (H100, "bfloat16"), (A100, "bfloat16"),
                                              (T4, "float16"), (V100, "float16"), (DeviceFacts("mps"), "float16")])
def test_auto_is_bf16_where_native_fp16_on_older_gpus_fp32_on_cpu(facts, dtype):
    assert auto_dtype(facts) == dtype
    assert resolve_dtype("auto", facts) == dtype


@pytest.mark.parametrize("facts", [CPU, H100, T4])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_explicit_dtype_is_kept(facts, dtype):
    assert resolve_dtype(dtype, facts) == dtype


def test_bf16_is_refused_on_a_gpu_that_only_emulates_it():
    assert resolve_dtype("bfloat16", H100) == "bfloat16"
    assert resolve_dtype("bfloat16", CPU) == "bfloat16"  # torch's CPU bf16 is real, if slow: allowed as today
    with pytest.raises(ModelLoadError) as err:
        resolve_dtype("bfloat16", T4)
    message = str(err.value)
    assert "\n" not in message
    assert message == ("--dtype bfloat16: Tesla T4 (compute capability 7.5) has no native bfloat16 (it needs "
                       "compute capability 8.0 or later); use --dtype float16, or auto")


def test_probe_on_this_cpu_says_cpu():
    assert probe(torch.device("cpu")) == CPU
