import json

import pytest
from transformers import AutoTokenizer

from quantize.calibration import build_calibration_set, load_texts
from quantize.errors import QuantizeError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_windows_from_data_dir(tiny_data_dir, tokenizer):
    calib = build_calibration_set(tiny_data_dir, tokenizer, num_samples=6, seq_len=64)
    assert len(calib.input_ids) == 6 and all(len(w) == 64 for w in calib.input_ids)
    assert calib.source == tiny_data_dir / "calibration.jsonl"
    assert calib.input_ids[0][0] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in calib.input_ids[0]
    examples = calib.as_gptqmodel_examples()
    assert examples[0]["attention_mask"] == [1] * 64
    again = build_calibration_set(tiny_data_dir, tokenizer, num_samples=6, seq_len=64)
    assert again.digest == calib.digest
    assert build_calibration_set(tiny_data_dir, tokenizer, num_samples=5, seq_len=64).digest != calib.digest


def test_user_jsonl_and_short_corpus(tmp_path, tokenizer, caplog):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"hello number {i}"}) for i in range(3)) + "\n")
    calib = build_calibration_set(path, tokenizer, num_samples=100, seq_len=16)
    assert calib.source == path and 1 <= len(calib.input_ids) < 100
    assert "enough for" in caplog.text


def test_bad_records_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(QuantizeError, match=r"bad.jsonl:2: not valid JSON"):
        load_texts(path)
    path.write_text('{"text": "ok"}\n{"prompt": "x"}\n')
    with pytest.raises(QuantizeError, match=r"bad.jsonl:2: .*'text'"):
        load_texts(path)
    with pytest.raises(QuantizeError, match="file not found"):
        load_texts(tmp_path / "missing.jsonl")


def test_limit(tiny_data_dir):
    assert len(load_texts(tiny_data_dir / "text_heldout.jsonl", limit=5)) == 5


def test_bos_not_doubled_on_chat_rendered_text(tmp_path, tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "<s><|user|>\nhi<|end|>\n"}) + "\n" + json.dumps({"text": "plain"}) + "\n")
    stream = build_calibration_set(path, tokenizer, num_samples=1, seq_len=64).input_ids[0]
    bos = tokenizer.bos_token_id
    assert stream[0] == bos and stream[1] != bos
    assert stream.count(bos) == 2  # one per text
