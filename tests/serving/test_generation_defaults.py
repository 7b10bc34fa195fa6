"""The model's generation_config.json sampling defaults: read and checked at load, applied by a real server
to the fields a request leaves out, and never over a value the request gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from openai import OpenAI
from test_api_server import MODEL, running_server

from serving.engine import EngineConfig, ModelLoadError
from serving.engine.generation_defaults import SamplingDefaults, read_sampling_defaults


def _write_generation_config(model_dir: Path, **values: object) -> None:
    path = model_dir / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(data | values))


def test_only_the_sampling_keys_present_are_taken(tmp_path):
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()  # no file: every field falls back
    _write_generation_config(tmp_path, do_sample=True, temperature=0.7, top_p=0.8, top_k=20, eos_token_id=[1],
                             max_new_tokens=512, repetition_penalty=None)
    defaults = read_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20)
    assert defaults.given() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@pytest.mark.parametrize("values, needle", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 0.0}, "top_p: must be in (0, 1]"),
    ({"temperature": -1}, "temperature: must be >= 0"),
])
def test_a_bad_default_names_the_file_and_key(tmp_path, values, needle):
    _write_generation_config(tmp_path, **values)
    with pytest.raises(ModelLoadError, match="generation_config.json") as info:
        read_sampling_defaults(tmp_path)
    assert needle in str(info.value)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        read_sampling_defaults(tmp_path)


def _texts(client: OpenAI, seeds: range, **kwargs: object) -> list[str]:
    return [client.completions.create(model=MODEL, prompt="Once", max_tokens=12, seed=seed, **kwargs).choices[0].text
            for seed in seeds]


def test_server_samples_at_the_models_default_temperature_unless_the_request_names_one(micro_base_dir, tmp_path):
    cfg = EngineConfig(num_blocks=128, block_size=8, max_num_seqs=8)
    with running_server(micro_base_dir, cfg) as (base, engine):  # no temperature in the file: OpenAI's 1.0
        assert engine.sampling_defaults == SamplingDefaults()
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert len(set(_texts(client, range(4)))) > 1  # sampled

    greedy_model = tmp_path / "greedy-model"
    shutil.copytree(micro_base_dir, greedy_model)
    _write_generation_config(greedy_model, temperature=0.0)
    with running_server(greedy_model, cfg) as (base, engine):
        assert engine.sampling_defaults.temperature == 0.0
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        defaulted = _texts(client, range(4))
        assert len(set(defaulted)) == 1  # the model's temperature 0: greedy whatever the seed
        assert defaulted[0] == _texts(client, range(1), temperature=0)[0]
        assert len(set(_texts(client, range(4), temperature=1.0))) > 1  # the request's value wins
