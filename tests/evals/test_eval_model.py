"""Loading a model dir for evaluation: chat template required, stop ids from generation_config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from evals.errors import EvalError
from evals.model import load_model


def test_micro_model_loads_fp32_on_cpu_with_eos_list(micro_lm, micro_base_dir):
    gen = json.loads((micro_base_dir / "generation_config.json").read_text())
    assert micro_lm.eos_ids == gen["eos_token_id"] and len(micro_lm.eos_ids) == 2
    assert micro_lm.device.type == "cpu" and next(micro_lm.model.parameters()).dtype == torch.float32
    assert micro_lm.max_context == micro_lm.model.config.max_position_embeddings
    prompt = micro_lm.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<s><|user|>\nhi") and prompt.endswith("<|assistant|>\n")


def test_tokenizer_without_chat_template_is_refused(micro_base_dir, tmp_path):
    model_dir = tmp_path / "no_template"
    shutil.copytree(micro_base_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    with pytest.raises(EvalError, match="no_template.*chat_template"):
        load_model(model_dir)


def test_missing_or_non_model_dir(tmp_path):
    with pytest.raises(EvalError, match="nowhere: model dir not found"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalError, match="empty: not a Hugging Face model dir"):
        load_model(tmp_path / "empty")


def test_single_int_eos_in_generation_config(micro_base_dir, tmp_path):
    model_dir = tmp_path / "one_eos"
    shutil.copytree(micro_base_dir, model_dir)
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text())
    gen["eos_token_id"] = gen["eos_token_id"][1]
    path.write_text(json.dumps(gen))
    assert load_model(model_dir).eos_ids == [gen["eos_token_id"]]
