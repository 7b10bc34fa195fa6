"""build_draft on the real micro model: a smaller HF model with the target's tokenizer, which distillation makes
agree with the target more often, which our engine serves as a speculative draft without changing a token, and
which refuses bad inputs in one line without leaving a directory behind."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flows.cli import main
from training.draft import CARRIED_FILES, DRAFT_RECORD, DraftBuild, build_draft, truncated_copy
from training.draft_config import DraftConfig, DraftError

# Small enough for a second on two busy cores; the micro model agrees 0.70 → ~0.94 at 60 steps.
FAST = dict(batch_size=8, seq_len=64, eval_tokens=2048)


@pytest.fixture(scope="module")
def distilled(micro_base_dir, tmp_path_factory) -> DraftBuild:
    return build_draft(micro_base_dir, tmp_path_factory.mktemp("drafts") / "distilled", DraftConfig(steps=60, **FAST))


@pytest.fixture(scope="module")
def truncated(micro_base_dir, tmp_path_factory) -> DraftBuild:
    """The same draft without distillation: the target's first layer as it is."""
    return build_draft(micro_base_dir, tmp_path_factory.mktemp("drafts") / "truncated", DraftConfig(steps=0, **FAST))


def _staging_leftovers(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_the_draft_is_a_one_layer_hf_model_with_the_targets_tokenizer(distilled, truncated, micro_base_dir):
    target = AutoModelForCausalLM.from_pretrained(micro_base_dir)
    draft = AutoModelForCausalLM.from_pretrained(distilled.path)
    assert draft.config.num_hidden_layers == len(draft.model.layers) == 1
    assert target.config.num_hidden_layers == distilled.target_layers == 2
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.hidden_size == target.config.hidden_size
    assert distilled.draft_params == sum(p.numel() for p in draft.parameters()) < distilled.target_params
    assert (distilled.path / "model.safetensors").is_file()
    carried = [name for name in CARRIED_FILES if (micro_base_dir / name).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(carried)
    for name in carried:
        assert (distilled.path / name).read_bytes() == (micro_base_dir / name).read_bytes(), name
    record = json.loads((distilled.path / DRAFT_RECORD).read_text())
    assert record["recipe"]["layers"] == 1 and record["recipe"]["steps"] == 60
    assert record["target"]["path"] == str(micro_base_dir) and len(record["target"]["weights_digest"]) == 64
    assert record["build"]["agreement"] == distilled.agreement
    assert not _staging_leftovers(distilled.path.parent)
    # without distillation the draft is the target's own embeddings, first layer, norm and (tied) head
    plain = AutoModelForCausalLM.from_pretrained(truncated.path).state_dict()
    for name, tensor in plain.items():
        assert torch.equal(tensor, target.state_dict()[name]), name


def test_distillation_raises_agreement_with_the_target(distilled, truncated):
    assert distilled.agreement_before == truncated.agreement_before == truncated.agreement  # same held-out text
    assert distilled.heldout_tokens == 2048
    # measured: 0.70 → 0.93..0.96 (depending on lr and steps)
    assert 0.5 < distilled.agreement_before < 0.8
    assert distilled.agreement >= distilled.agreement_before + 0.1
    assert distilled.agreement >= 0.85
    assert distilled.final_loss is not None and truncated.final_loss is None


def test_our_engine_serves_it_as_a_draft_and_the_output_stays_greedy(micro_base_dir, distilled, truncated):
    from tests.serving.test_speculative import PROMPTS
    from tests.serving.test_speculative_draft import GREEDY, _draft_blocks_all_free, _engine

    plain = _engine(micro_base_dir)
    acceptance = {}
    for build in (distilled, truncated):
        spec = _engine(micro_base_dir, draft=build.path)
        for prompt in PROMPTS:
            (want,), (got,) = plain.generate([prompt], GREEDY), spec.generate([prompt], GREEDY)
            assert (got.token_ids, got.text) == (want.token_ids, want.text), prompt
        assert _draft_blocks_all_free(spec)
        acceptance[build.steps] = spec.speculation.accepted / spec.speculation.drafted
    # measured: 0.58 for the plain first layer, 0.72 distilled
    assert acceptance[60] > acceptance[0] + 0.05, acceptance


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_truncated_copy_computes_what_the_targets_first_layers_compute(model_type):
    cfg = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    draft = truncated_copy(target, 2).eval()
    assert draft.config.num_hidden_layers == 2 and len(getattr(draft.config, "layer_types", None) or [0, 0]) == 2
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        got = draft(input_ids=ids).logits
        target.model.layers = target.model.layers[:2]
        target.config.num_hidden_layers = 2
        assert torch.allclose(got, target(input_ids=ids).logits, atol=1e-5)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture()
def gpt2_dir(micro_base_dir, tmp_path) -> Path:
    """A real causal LM of another architecture, with the micro tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(micro_base_dir / name, out / name)
    return out


def test_bad_inputs_are_one_clear_draft_error_and_leave_no_output(micro_base_dir, gpt2_dir, tmp_path):
    out = tmp_path / "drafts" / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (tmp_path / "nowhere", DraftConfig(**FAST), f"draft target {tmp_path / 'nowhere'}: no such directory$"),
        (empty, DraftConfig(**FAST), f"draft target {empty}: missing config.json"),
        (micro_base_dir, DraftConfig(layers=2, **FAST),
         "layers 2: the target has 2 decoder layers; a draft keeps fewer \\(1 to 1\\)"),
        (micro_base_dir, DraftConfig(layers=5, **FAST), "layers 5: the target has 2 decoder layers"),
        (gpt2_dir, DraftConfig(**FAST), f"draft target {gpt2_dir}: model_type 'gpt2' cannot be cut into a draft"),
        (micro_base_dir, DraftConfig(seq_len=512, batch_size=8), "seq_len 512 exceeds the target's context"),
    ]
    for target, config, message in cases:
        with pytest.raises(DraftError, match=message):
            build_draft(target, out, config)
        assert not out.parent.exists(), message  # refused before anything was created
    with pytest.raises(DraftError, match=r"^texts: 1 distinct documents give \d+ training and 0 held-out tokens"):
        build_draft(micro_base_dir, out, DraftConfig(**FAST), texts=["just one short document"])
    assert not out.exists()
    for kwargs, field in ((dict(layers=0), "layers"), (dict(steps=-1), "steps"), (dict(temperature=0), "temperature"),
                          (dict(device="tpu"), "device")):
        with pytest.raises(DraftError, match=f"^{field}: must"):
            DraftConfig(**kwargs)
    with pytest.raises(DraftError, match="would replace the target"):
        build_draft(micro_base_dir, micro_base_dir, DraftConfig(**FAST), overwrite=True)
    out.mkdir(parents=True)
    with pytest.raises(DraftError, match=f"output {out}: already exists; remove it or pass --force"):
        build_draft(micro_base_dir, out, DraftConfig(**FAST))
    assert not any(out.iterdir()) and not _staging_leftovers(out.parent)


def test_the_cli_builds_a_draft_or_says_what_is_wrong_in_one_line(micro_base_dir, tmp_path, capsys):
    from training.base_model import BaseModelConfig
    from training.corpus import build_corpus

    out = tmp_path / "cli-draft"
    assert main(["draft", "build", "--target", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert main(["draft", "build", "--target", str(micro_base_dir), "--out", str(out), "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: draft target {tmp_path / 'nowhere'}: no such directory",
                   "error: --batch-size: must be >= 1, got 0"]
    assert not out.exists()

    texts = tmp_path / "texts.jsonl"  # the caller's own documents
    docs = build_corpus(BaseModelConfig(preset="micro").corpus_spec())
    texts.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    assert main(["draft", "build", "--target", str(micro_base_dir), "--out", str(out), "--steps", "20",
                 "--batch-size", "8", "--seq-len", "64", "--eval-tokens", "1024", "--text-file", str(texts)]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"agreement\s+0\.\d{3} → 0\.\d{3}", stdout), stdout
    assert "1 of 2" in stdout and "documents from the caller" in stdout
    assert f"lifecycle serve {micro_base_dir} --speculative-tokens 4 --speculative-model {out}" in stdout
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 1
