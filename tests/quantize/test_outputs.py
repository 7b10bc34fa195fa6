import pytest

from quantize.outputs import copy_sidecars, staged_dir, weights_size


def test_staged_dir_replaces_atomically_and_cleans_up(tmp_path):
    out = tmp_path / "gptq"
    with staged_dir(out) as tmp:
        (tmp / "a.safetensors").write_bytes(b"x" * 10)
    assert (out / "a.safetensors").is_file() and out.stat().st_mode & 0o755 == 0o755
    with staged_dir(out) as tmp:
        (tmp / "b.safetensors").write_bytes(b"y" * 3)
    assert sorted(p.name for p in out.iterdir()) == ["b.safetensors"]
    with pytest.raises(RuntimeError), staged_dir(out) as tmp:
        (tmp / "c.bin").write_bytes(b"z")
        raise RuntimeError("quantizer crashed")
    assert sorted(p.name for p in out.iterdir()) == ["b.safetensors"]  # previous output untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptq"]  # no temp or old dirs left
    assert weights_size(out) == 3


def test_copy_sidecars(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "generation_config.json").write_text('{"eos_token_id": [5, 1]}')
    (dst / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert copy_sidecars(src, dst) == ["tokenizer.json", "generation_config.json"]
    assert (dst / "generation_config.json").read_text() == '{"eos_token_id": [5, 1]}'
