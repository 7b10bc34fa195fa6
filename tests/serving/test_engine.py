"""LLMEngine end to end on a real tiny Llama: token-identical to HF greedy generate under every mode."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from serving.engine import EngineConfig, LLMEngine, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(7, 400) for _ in range(37)]  # a shared "system prompt"
    ps = [[rng.randrange(7, 400) for _ in range(rng.randint(2, 60))] for _ in range(6)]
    ps += [shared + [rng.randrange(7, 400) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    return ps


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    out = []
    with torch.no_grad():
        for p in prompts:
            g = hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("name,cfg", [
    ("prefix-cache+chunked", EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=24)),
    ("no-prefix-cache", EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=24,
                                     enable_prefix_caching=False)),
    ("preemption", EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=24)),
    ("no-chunking", EngineConfig(num_blocks=256, block_size=8, max_num_batched_tokens=128,
                                 enable_chunked_prefill=False)),
    ("hf-forward", EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=24, model_impl="hf")),
    ("compact-forward", EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=24,
                                     model_impl="compact")),
])
def test_greedy_matches_hf_generate(tiny_model_dir, prompts, reference, name, cfg):
    engine = LLMEngine.from_pretrained(tiny_model_dir, cfg)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    st = engine.stats()
    assert st.kv_usage == 0.0 and st.num_running == 0 and st.num_waiting == 0
    if name == "prefix-cache+chunked":
        assert st.prefix_cache_hits >= 3 * 36  # the shared prompt was computed once, reused 3 times
    if name == "preemption":
        assert st.num_preemptions > 0


def test_generate_takes_more_prompts_than_the_queue_holds(tiny_model_dir, prompts, reference):
    # Queueing the later prompts steps the engine, and those steps finish earlier ones: generate must keep them
    # (it once dropped them and waited for them forever).
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=256, block_size=4, max_num_seqs=2,
                                                                   max_queue=2, max_num_batched_tokens=64))
    outs = engine.generate(prompts * 3, GREEDY)
    assert [o.token_ids for o in outs] == reference * 3


def test_requests_joining_between_steps_match_too(tiny_model_dir, prompts, reference):
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4,
                                                                   max_num_batched_tokens=16))
    done = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # one new request every step, while others decode
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o.token_ids
    assert [done[i] for i in range(len(prompts))] == reference


def test_abort_frees_blocks_in_that_step(tiny_model_dir):
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4))
    for i in range(3):
        engine.add_request(f"r{i}", [10 + i] * 9, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_usage > 0
    for i in range(3):
        engine.abort(f"r{i}")
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished and o.finish_reason == "abort"} == {"r0", "r1", "r2"}
    assert engine.stats().kv_usage == 0.0 and not engine.has_unfinished()


def test_stop_rules_and_lengths(tiny_model_dir, prompts, reference):
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4))
    ref = reference[0]
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    o = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                     stop_token_ids=[stop_tok]))[0]
    assert o.token_ids == ref[:first + 1] and o.finish_reason == "stop" and o.outputs[0].stop_reason == stop_tok
    o = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert o.token_ids == ref[:3] and o.finish_reason == "length"
    full = engine.generate([prompts[0]], GREEDY)[0].text
    if len(full) > 4:
        stop = full[2:4]
        o = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                         stop=[stop]))[0]
        assert o.finish_reason == "stop" and o.text == full[:full.index(stop)]


def test_prompt_logprobs_match_hf_and_prefill_only_requests(tiny_model_dir, hf_model, prompts):
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4,
                                                                   max_num_batched_tokens=16))
    p = prompts[1]
    o = engine.generate([p], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert o.token_ids == [] and o.finished and len(o.prompt_logprobs) == len(p)
    with torch.no_grad():
        lp = hf_model(torch.tensor([p])).logits[0].log_softmax(-1)
    assert o.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        assert o.prompt_logprobs[i][p[i]] == pytest.approx(lp[i - 1, p[i]].item(), abs=1e-4)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir, prompts):
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4))
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    alone = engine.generate([prompts[2]], sp)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batched = engine.generate(prompts[:4], [others, others, sp, others])[2].token_ids
    assert alone == batched


def test_engine_seed_drives_unseeded_sampling_and_leaves_the_global_rng_alone(tiny_model_dir, prompts):
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(engine_seed: int, global_seed: int) -> list[list[int]]:
        engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4,
                                                                       seed=engine_seed))
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        outs = [o.token_ids for o in engine.generate(prompts[:4], unseeded)]
        outs += [o.token_ids for o in engine.generate(prompts[4:6], unseeded)]  # the stream goes on
        assert torch.equal(torch.get_rng_state(), state)
        return outs

    first = run(7, global_seed=1)
    assert run(7, global_seed=2) == first  # same engine seed, same request stream: same tokens
    assert run(8, global_seed=1) != first


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.5, True, "0"])
def test_engine_seed_must_be_a_64_bit_unsigned_integer(seed):
    with pytest.raises(ValueError, match="^seed:"):
        EngineConfig(seed=seed)
