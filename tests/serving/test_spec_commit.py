"""Guesses through one step, driven through the scheduler: appended before the plan, trimmed to what it computes,
the agreeing ones emitted with the model's own token, the rest rolled back, none left after the step."""

from __future__ import annotations

from serving.engine.config import EngineConfig
from serving.engine.outputs import ModelOutput
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=10)


class FixedGuesses:
    """A proposer that guesses the same tokens for everyone and records what the scheduler tells it."""

    draft_cost_ratio = None

    def __init__(self, guesses: list[int]) -> None:
        self.guesses = guesses
        self.observed: list[tuple[str, int, int]] = []
        self.forward_seconds: list[float] = []
        self.released: list[str] = []

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        return {seq.request_id: self.guesses[:room] for seq, room in zip(seqs, rooms)}

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        self.observed.append((request_id, drafted, kept))

    def observe_step(self, target_seconds: float) -> None:
        self.forward_seconds.append(target_seconds)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def _decoding(proposer: FixedGuesses, *prompts: list[int], **cfg) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose sequences have prefilled and sampled token 5: greedy decodes, ready for guesses."""
    sched = Scheduler(EngineConfig(block_size=4, num_blocks=64, **cfg), 64, max_model_len=256, proposer=proposer)
    seqs = [Sequence(f"s{i}", list(p), GREEDY, arrival_time=float(i)) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    assert not plan.drafted  # prefilling sequences get no guesses
    sched.launched(plan, [True] * len(seqs))
    sched.update_from_output(plan, ModelOutput([True] * len(seqs), sampled={i: (5, None) for i in range(len(seqs))}))
    return sched, seqs


def test_agreeing_guesses_are_emitted_with_the_models_token_and_the_rest_rolled_back():
    proposer = FixedGuesses([6, 7, 8])
    sched, (a,) = _decoding(proposer, [1, 2, 3, 4])
    plan = sched.schedule()
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and a.draft_token_ids == [6, 7, 8]
    assert [(item.seq, item.num_tokens) for item in plan.scheduled] == [(a, 4)]  # the last real token + 3 guesses
    (out,) = sched.update_from_output(plan, ModelOutput([False], verified={0: [6, 7, 9, 3]}, forward_seconds=0.5))
    plan.drop_drafts()
    assert out.delta_token_ids == [6, 7, 9] and not out.finished
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7, 9] and a.draft_token_ids == []
    assert a.num_computed_tokens == 7  # 9 is the model's own: computed next step; 8's slot is free again
    assert proposer.observed == [("s0", 3, 2)] and proposer.forward_seconds == [0.5]
    stats = sched.speculator.stats
    assert (stats.steps, stats.drafted, stats.accepted) == (1, 3, 2)
    assert sched.generation_tokens_total == 4


def test_a_stop_rule_inside_the_kept_guesses_ends_the_sequence_there():
    proposer = FixedGuesses([6, 7, 8])
    sched, (a,) = _decoding(proposer, [1, 2, 3, 4])
    a.params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[7])
    plan = sched.schedule()
    (out,) = sched.update_from_output(plan, ModelOutput([False], verified={0: [6, 7, 8, 3]}))
    assert out.finished and out.finish_reason == "stop" and out.token_ids == [5, 6, 7]
    assert proposer.released == ["s0"] and sched.bm.usage() == 0.0
    assert proposer.forward_seconds == []  # no forward time: nothing to weigh the draft against


def test_the_plan_keeps_only_the_guesses_it_computes_and_none_survive_the_step():
    proposer = FixedGuesses([6, 7, 8])
    sched, (a, b) = _decoding(proposer, [1, 2], [11, 12], max_num_batched_tokens=6)
    plan = sched.schedule()
    assert [(item.seq, item.num_tokens) for item in plan.scheduled] == [(a, 4), (b, 2)]  # the budget cut b short
    assert a.draft_token_ids == [6, 7, 8] and b.draft_token_ids == [6] and b.token_ids == [11, 12, 5, 6]
    outs = sched.update_from_output(plan, ModelOutput([False, False], verified={1: [6, 9]},
                                                      errors={0: RuntimeError("boom")}))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("s0", "error"), ("s1", None)]
    plan.drop_drafts()
    assert a.draft_token_ids == [] and a.token_ids == [1, 2, 5]
    assert b.token_ids == [11, 12, 5, 6, 9] and b.num_computed_tokens == 4
