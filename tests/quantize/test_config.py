import pytest

from artifacts.errors import LifecycleError
from quantize.config import QuantizeConfig, check_model_compat
from quantize.errors import QuantizeError, QuantizeGateError

LLAMA = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 768}


def test_defaults_are_valid():
    cfg = QuantizeConfig()
    assert cfg.methods == ["gptq", "awq"] and cfg.bits == 4 and cfg.group_size == 128
    assert QuantizeConfig().methods is not cfg.methods  # no shared mutable default


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"methods": ["gptq", "bnb"]}, "methods"),
        ({"methods": []}, "methods"),
        ({"methods": ["gptq", "gptq"]}, "methods"),
        ({"bits": 5}, "bits"),
        ({"methods": ["awq"], "bits": 3}, "bits"),
        ({"group_size": 48}, "group_size"),
        ({"group_size": 0}, "group_size"),
        ({"calibration_samples": 0}, "calibration_samples"),
        ({"calibration_seq_len": 4}, "calibration_seq_len"),
        ({"fidelity_samples": -1}, "fidelity_samples"),
        ({"calibration_batch_size": 0}, "calibration_batch_size"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        QuantizeConfig(**kwargs)


def test_gptq_alone_allows_3_bits_and_per_channel():
    QuantizeConfig(methods=["gptq"], bits=3, group_size=-1)


def test_group_size_must_divide_in_features():
    check_model_compat(QuantizeConfig(group_size=128), LLAMA)
    # intermediate 768 = 3 * 256: divisible by 256 only for the hidden-sized inputs.
    with pytest.raises(QuantizeError, match="group_size 512 does not divide") as err:
        check_model_compat(QuantizeConfig(group_size=512), LLAMA, source="m/config.json")
    assert "m/config.json" in str(err.value) and "q_proj" in str(err.value)
    check_model_compat(QuantizeConfig(group_size=-1), LLAMA)


def test_awq_needs_out_features_multiple_of_64():
    narrow_kv = {**LLAMA, "num_key_value_heads": 1}  # v_proj out = 32
    with pytest.raises(QuantizeError, match="v_proj"):
        check_model_compat(QuantizeConfig(), narrow_kv)
    check_model_compat(QuantizeConfig(methods=["gptq"]), narrow_kv)


def test_missing_architecture_fields():
    with pytest.raises(QuantizeError, match="hidden_size"):
        check_model_compat(QuantizeConfig(), {"model_type": "bert"})


def test_error_hierarchy():
    assert issubclass(QuantizeError, LifecycleError)
    assert issubclass(QuantizeGateError, QuantizeError)
