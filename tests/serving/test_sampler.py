"""Sampler: greedy, top-k/top-p/min-p filtering, penalties, seeds, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p, prompt_logprobs
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence

V = 10


def seq(prompt=(1, 2), output=(), eos=frozenset({9}), **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params), eos_token_ids=eos)
    s.token_ids += list(output)
    return s


def logits_row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, V)
    out = Sampler()(logits, [seq(temperature=0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_top_p_min_p_keep_the_expected_sets():
    x = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    def kept(y):
        return torch.isfinite(y[0]).nonzero().flatten().tolist()
    def one(v, t=torch.float32):
        return torch.tensor([v], dtype=t)
    assert kept(apply_top_k_top_p_min_p(x, one(2, torch.long), one(1.0), one(0.0))) == [0, 1]
    assert kept(apply_top_k_top_p_min_p(x, one(0, torch.long), one(0.7), one(0.0))) == [0, 1]
    assert kept(apply_top_k_top_p_min_p(x, one(0, torch.long), one(0.76), one(0.0))) == [0, 1, 2]
    assert kept(apply_top_k_top_p_min_p(x, one(0, torch.long), one(1.0), one(0.3))) == [0, 1, 2]
    # rows are independent
    xx = x.repeat(2, 1)
    y = apply_top_k_top_p_min_p(xx, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert kept(y[:1]) == [0] and kept(y[1:]) == [0, 1, 2, 3, 4]


def test_sampling_stays_inside_top_k_and_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs.clamp_min(1e-9)).repeat(4000, 1)
    seqs = [seq(temperature=1.0, top_k=2) for _ in range(4000)]
    toks = torch.tensor(Sampler()(logits, seqs).token_ids)
    assert set(toks.tolist()) <= {0, 1}
    assert abs((toks == 0).float().mean().item() - 0.6 / 0.9) < 0.05


def test_seed_makes_a_request_reproducible_whatever_its_batch():
    logits = torch.randn(1, V)
    s1 = seq(temperature=1.0, seed=7)
    s2 = seq(temperature=1.0, seed=7)
    batch = torch.cat([torch.randn(3, V), logits])
    first = [Sampler()(logits, [s1]).token_ids[0] for _ in range(20)]
    second = [Sampler()(batch, [seq(temperature=1.0)] * 3 + [s2]).token_ids[3] for _ in range(20)]
    assert first == second
    assert len(set(first)) > 1  # it does sample (not greedy)


def test_presence_frequency_and_repetition_penalties():
    logits = torch.zeros(1, V)
    s = seq(prompt=(3,), output=(5, 5, 6), presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [s])
    assert logits[0, 5].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert logits[0, 6].item() == pytest.approx(-(0.5 + 0.25))
    assert logits[0, 3].item() == 0.0  # presence/frequency look at output tokens only
    rep = torch.tensor([[2.0, -2.0, 1.0] + [0.0] * (V - 3)])
    apply_penalties(rep, [seq(prompt=(0,), output=(1,), repetition_penalty=2.0)])
    assert rep[0, :3].tolist() == [1.0, -4.0, 1.0]


def test_penalty_changes_the_greedy_choice():
    logits = logits_row([0.0, 3.0, 2.9] + [0.0] * (V - 3))
    assert Sampler()(logits, [seq(temperature=0)]).token_ids == [1]
    assert Sampler()(logits, [seq(output=(1,), temperature=0, presence_penalty=1.0)]).token_ids == [2]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = logits_row([0.0] * (V - 1) + [10.0])  # eos (9) is the favourite
    assert Sampler()(logits, [seq(temperature=0, min_tokens=2)]).token_ids != [9]
    assert Sampler()(logits, [seq(output=(4, 4), temperature=0, min_tokens=2)]).token_ids == [9]
    logits2 = logits_row([0.0] * 7 + [10.0, 0.0, 0.0])
    assert Sampler()(logits2, [seq(temperature=0, min_tokens=1, stop_token_ids=[7])]).token_ids != [7]


def test_logprobs_are_raw_log_softmax_with_sampled_token_first():
    logits = torch.randn(2, V)
    seqs = [seq(temperature=0, logprobs=3), seq(temperature=0)]
    out = Sampler()(logits, seqs)
    rec = out.logprobs[0]
    lp = logits[0].log_softmax(-1)
    assert next(iter(rec)) == out.token_ids[0]
    top3 = lp.topk(3).indices.tolist()
    assert set(rec) == set(top3) | {out.token_ids[0]}
    for t, v in rec.items():
        assert v == pytest.approx(lp[t].item(), abs=1e-5)
    assert out.logprobs[1] is None
    recs = prompt_logprobs(logits, [4, 2], 1)
    assert recs[0][4] == pytest.approx(lp[4].item(), abs=1e-5)
    assert sum(math.exp(v) for v in [lp[t].item() for t in range(V)]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3),
                                         ("min_p", 2.0), ("max_tokens", -1), ("logprobs", 50),
                                         ("presence_penalty", 3.0), ("repetition_penalty", 0.0)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_unseeded_rows_draw_from_the_samplers_seed_not_the_global_rng():
    logits = torch.randn(64, V)
    seqs = [seq(temperature=1.0) for _ in range(64)]

    def draws(sampler_seed: int, global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        sampler = Sampler(seed=sampler_seed)
        out = [sampler(logits, seqs).token_ids for _ in range(3)]
        assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not used
        return out

    assert draws(5, global_seed=1) == draws(5, global_seed=2)
    assert draws(5, global_seed=1) != draws(6, global_seed=1)
