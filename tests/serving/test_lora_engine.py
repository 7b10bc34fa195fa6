"""LoRA adapters in the engine (issue 33, item 1): a base and several adapters in the same batch, each request
answered as PEFT's own ``generate`` answers it, adapters resident up to ``max_loras`` (least recently used out),
the prefix cache keeping one adapter's KV from another's, and an adapter of another base refused.

The adapters are real PEFT adapters of the tiny Llama, saved with ``save_pretrained``; their B matrices are
drawn at random (PEFT starts B at zero, which would make every adapter the base), one targeting attention only
at rank 8, one every projection at rank 4 with rsLoRA scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving.engine import EngineConfig, LoraError, SamplingParams, UnknownAdapterError
from serving.engine.engine import LLMEngine
from tests.lora_support import make_adapter
from tests.serving.conftest import build_tiny_model

PROMPTS = ["the cat sat on", "a small model", "the cat sat on", "numbers and words"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"attn": make_adapter(tiny_model_dir, root / "attn", rank=8, targets=["q_proj", "v_proj", "o_proj"],
                                 seed=1),
            "all": make_adapter(tiny_model_dir, root / "all", rank=4, seed=2, rslora=True,
                                targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"])}


def peft_greedy(base_dir: Path, adapter: Path | None, prompts: list[str]) -> list[list[int]]:
    """What PEFT's (or the plain model's) generate answers, greedy, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id, min_new_tokens=MAX_TOKENS)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(**{"max_loras": 2, "max_lora_rank": 8, "kv_memory_bytes": 8 << 20, **overrides})
    return LLMEngine.from_pretrained(model_dir, config)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_a_base_and_two_adapters_in_one_batch_each_answer_as_peft_does(tiny_model_dir, adapters):
    eng = engine(tiny_model_dir)
    for name, path in adapters.items():
        eng.load_lora(name, path)
    loras = [None, "attn", "all", "attn"] * 2
    prompts = PROMPTS * 2
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY, loras=loras)]
    expected = {None: peft_greedy(tiny_model_dir, None, PROMPTS),
                **{name: peft_greedy(tiny_model_dir, path, PROMPTS) for name, path in adapters.items()}}
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        assert got[i] == expected[lora][PROMPTS.index(prompt)], (prompt, lora)
    # the adapters change the answers (or the comparison above would prove nothing)
    assert expected["attn"] != expected[None] and expected["all"] != expected[None]


def test_one_slot_serves_two_adapters_in_turn(tiny_model_dir, adapters):
    """max_loras 1: the second adapter's requests wait until the first's finish, then it is loaded into the
    slot (least recently used out); every answer is still its adapter's."""
    eng = engine(tiny_model_dir, max_loras=1)
    for name, path in adapters.items():
        eng.load_lora(name, path)
    loras = ["attn", "all", "attn", "all"]
    got = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY, loras=loras)]
    for name, path in adapters.items():
        want = peft_greedy(tiny_model_dir, path, PROMPTS)
        assert [g for g, lora in zip(got, loras) if lora == name] == \
            [w for w, lora in zip(want, loras) if lora == name]
    assert eng.runner.lora.loads >= 2 and not eng.runner.lora.running


def test_the_prefix_cache_keeps_adapters_apart(tiny_model_dir, adapters):
    """The same long prompt on the base, then on an adapter: the adapter must not reuse the base's KV blocks
    (its answer would be the base's), while a second request on the same adapter does hit its own."""
    eng = engine(tiny_model_dir)
    eng.load_lora("attn", adapters["attn"])
    prompt = " ".join(["the cat sat on the mat"] * 8)
    base = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    hits_before = eng.stats().prefix_cache_hits
    first = eng.generate([prompt], GREEDY, loras=["attn"])[0].outputs[0].token_ids
    assert eng.stats().prefix_cache_hits == hits_before  # nothing of the base's was reused
    again = eng.generate([prompt], GREEDY, loras=["attn"])[0].outputs[0].token_ids
    assert eng.stats().prefix_cache_hits > hits_before and again == first
    assert first == peft_greedy(tiny_model_dir, adapters["attn"], [prompt])[0] != base


def test_unknown_wrong_base_and_unsupported_adapters_are_refused(tiny_model_dir, adapters, tmp_path):
    eng = engine(tiny_model_dir)
    with pytest.raises(UnknownAdapterError, match="no adapter 'nope'"):
        eng.add_request("r1", [5, 6, 7], GREEDY, lora="nope")
    other_base = build_tiny_model(tmp_path / "wider", hidden=96)
    wrong = make_adapter(other_base, tmp_path / "wrong", rank=4, targets=["q_proj"], seed=3)
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: layer 0 q_proj is 96×96, the base's is 64×64"):
        eng.load_lora("wrong", wrong)
    big = make_adapter(tiny_model_dir, tmp_path / "big", rank=16, targets=["q_proj"], seed=4)
    with pytest.raises(LoraError, match=r"rank r=16 is outside 1..max_lora_rank \(8\)"):
        eng.load_lora("big", big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 4, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora"):
        eng.load_lora("dora", big)
    eng.load_lora("attn", adapters["attn"])
    with pytest.raises(LoraError, match="already loaded"):
        eng.load_lora("attn", adapters["attn"])
    assert list(eng.loras) == ["attn"]


def test_an_unloaded_adapter_lets_accepted_requests_finish(tiny_model_dir, adapters):
    eng = engine(tiny_model_dir)
    eng.load_lora("attn", adapters["attn"])
    eng.add_request("kept", eng.encode(PROMPTS[0]), GREEDY, lora="attn")
    eng.unload_lora("attn")
    with pytest.raises(UnknownAdapterError):
        eng.add_request("refused", eng.encode(PROMPTS[0]), GREEDY, lora="attn")
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["kept"] == peft_greedy(tiny_model_dir, adapters["attn"], PROMPTS[:1])[0]
    assert not eng.runner.lora.resident  # its slot is free again


def test_a_lora_step_adds_each_rows_own_adapter_whether_its_rows_are_together_or_apart():
    """Rows of one adapter side by side are read as a slice, rows apart are gathered: both add, to each row,
    its own adapter's B·A·x (checked row by row against the plain product), and nothing to the base's rows."""
    from serving.engine.lora import LoraBatch

    gen = torch.Generator().manual_seed(0)
    shrink, expand = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, 6, generator=gen)  # expand: Bᵀ
    row_slots = [-1, 2, 2, 0, -1, 1, 0, 2]  # slot 2: rows 1-2 and 7 (apart); slot 0: 3 and 6; slot 1: 5
    x, base = torch.randn(len(row_slots), 8, generator=gen), torch.randn(len(row_slots), 6, generator=gen)
    batch = LoraBatch.from_row_slots(row_slots, torch.device("cpu"))
    contiguous = LoraBatch.from_row_slots([-1, 1, 1, 0, 0, 2], torch.device("cpu"))
    assert not contiguous.scattered and len(contiguous.runs) == 3
    assert batch.runs == [(1, 5, 6)] and {slot for slot, _ in batch.scattered} == {0, 2}
    out = base.clone()
    batch.add(out, x, shrink, expand)
    for row, slot in enumerate(row_slots):
        want = base[row] if slot < 0 else base[row] + expand[slot].T @ (shrink[slot] @ x[row])
        assert torch.allclose(out[row], want, atol=1e-5), row
    assert LoraBatch.from_row_slots([-1, -1], torch.device("cpu")) is None


def test_the_cpu_kernel_adds_what_the_torch_path_adds():
    """``lora_add`` (csrc/lora.cpp) against ``LoraBatch.add`` on a fused projection of three parts (q, k, v),
    with an adapter of rank below the slots' and rows of three adapters and the base mixed."""
    from serving.engine import cpu_kernels
    from serving.engine.lora import LoraBatch, LoraSlots

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels are not built here (no compiler); the engine uses the torch path")
    gen = torch.Generator().manual_seed(1)
    slots = LoraSlots({"qkv": [32, 16, 16]}, {"qkv": 48}, num_layers=1, max_loras=3, max_rank=8,
                      dtype=torch.float32, device=torch.device("cpu"))
    shrink, expand = slots.shrink[0]["qkv"], slots.expand[0]["qkv"]
    shrink.copy_(torch.randn(shrink.shape, generator=gen))
    for s in range(3):  # block-diagonal B, as LoraSlots.write lays it out
        for j, (start, out) in enumerate(((0, 32), (32, 16), (48, 16))):
            expand[s, j * 8:j * 8 + 8, start:start + out] = torch.randn(8, out, generator=gen)
    row_slots = [0, 0, -1, 2, 1, 1, 2, -1, 0]
    x, base = torch.randn(len(row_slots), 48, generator=gen), torch.randn(len(row_slots), 64, generator=gen)
    batch = LoraBatch.from_row_slots(row_slots, torch.device("cpu"))
    with_torch, with_kernel = base.clone(), base.clone()
    batch.add(with_torch, x, shrink, expand)
    kernels.lora_add(with_kernel, x, shrink, expand, batch.row_slots, slots.parts["qkv"], slots.max_rank)
    assert torch.allclose(with_kernel, with_torch, atol=1e-4)
    assert torch.equal(with_kernel[2], base[2]) and not torch.allclose(with_kernel[0], base[0])
