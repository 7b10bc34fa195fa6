
from quantize.outputs import copy_sidecars, weights_size


def test_weights_size_counts_weight_files_only(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"y" * 3)
    (tmp_path / "config.json").write_text("{}")
    assert weights_size(tmp_path) == 3


def test_copy_sidecars(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "generation_config.json").write_text('{"eos_token_id": [5, 1]}')
    (dst / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert copy_sidecars(src, dst) == ["tokenizer.json", "generation_config.json"]
    assert (dst / "generation_config.json").read_text() == '{"eos_token_id": [5, 1]}'
