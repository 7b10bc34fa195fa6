"""Scheduler: token budget, chunked prefill, decode priority, preemption by recompute, queue limits."""

from __future__ import annotations

import pytest

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching))


def seq(rid: str, n: int, arrival: float, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=64), arrival_time=arrival)


def execute(sched: Scheduler, out, sampled_token: int = 1) -> None:
    """Stand-in for the runner: mark computed, append a token when the sequence finished its prefill."""
    for item in out.scheduled:
        s = item.seq
        s.num_computed_tokens += item.num_tokens
        sched.bm.commit_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(sampled_token)


def test_budget_limits_tokens_per_step_and_chunks_long_prompts():
    sched = make(max_num_batched_tokens=16)
    long = seq("long", 40, 0.0)
    sched.add(long)
    out = sched.schedule()
    assert out.plan() == {"long": 16}
    execute(sched, out)
    assert sched.schedule().plan() == {"long": 16}


def test_long_prompt_does_not_stall_running_decodes():
    sched = make(max_num_batched_tokens=16)
    short = seq("short", 3, 0.0)
    sched.add(short)
    execute(sched, sched.schedule())  # short prefilled, now decoding
    sched.add(seq("long", 100, 1.0, start=500))
    for _ in range(4):
        out = sched.schedule()
        plan = out.plan()
        assert plan["short"] == 1  # every step, the decode runs
        assert plan["long"] == 15  # the prompt takes what is left of the budget
        assert out.num_tokens <= 16
        execute(sched, out)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = seq("a", 10, 0.0), seq("b", 10, 1.0, start=100)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().plan() == {"a": 10}  # b does not fit the rest of the budget, whole or not


def test_max_num_seqs_caps_the_running_batch():
    sched = make(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(f"s{i}", 3, float(i), start=10 * i))
    assert set(sched.schedule().plan()) == {"s0", "s1"}
    assert len(sched.waiting) == 2


def test_admission_waits_for_free_blocks():
    sched = make(num_blocks=4, block_size=4)
    sched.add(seq("a", 12, 0.0))
    sched.add(seq("b", 8, 1.0, start=100))
    assert set(sched.schedule().plan()) == {"a"}  # a holds 3 of 4 blocks; b needs 2
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_preemption_by_recompute_frees_the_newest_and_requeues_it():
    sched = make(num_blocks=4, block_size=4)
    a, b = seq("a", 8, 0.0), seq("b", 7, 1.0, start=100)
    sched.add(a)
    sched.add(b)
    execute(sched, sched.schedule())  # a: 8 tokens (2 blocks), b: 7 tokens (2 blocks) -> cache full
    assert sched.bm.num_free_blocks == 0
    out = sched.schedule()  # a needs a third block for token 9: b is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert out.plan() == {"a": 1}
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.token_ids[-1] == 1  # its output token is kept; it will be recomputed, not resampled
    assert sched.num_preemptions == 1 and sched.waiting[0] is b


def test_finished_sequences_leave_and_free_blocks_in_that_step():
    sched = make(num_blocks=8)
    a = seq("a", 9, 0.0)
    sched.add(a)
    execute(sched, sched.schedule())
    assert sched.bm.num_used_blocks == 3
    sched.remove(a)
    assert sched.bm.usage() == 0.0 and not sched.has_unfinished()


def test_priority_then_arrival_orders_admission():
    sched = make(max_num_seqs=1)
    late_urgent = seq("urgent", 3, 5.0)
    late_urgent.priority = -1
    sched.add(seq("early", 3, 0.0, start=50))
    sched.add(late_urgent)
    assert list(sched.schedule().plan()) == ["urgent"]


def test_engine_admission_rejects_unservable_and_overflowing_queues(tiny_model_dir):
    from serving.engine import EngineConfig as EC
    from serving.engine import InvalidRequestError, LLMEngine, QueueFullError

    eng = LLMEngine.from_pretrained(tiny_model_dir, EC(num_blocks=8, block_size=4, max_queue=2))
    with pytest.raises(InvalidRequestError, match="max_tokens"):  # 10 + 30 tokens cannot fit 32 slots
        eng.add_request("big", list(range(10, 20)), SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequestError, match="context"):
        eng.add_request("ctx", list(range(10, 20)), SamplingParams(max_tokens=eng.max_model_len))
    eng.add_request("a", [10, 11], SamplingParams(max_tokens=2))
    eng.add_request("b", [10, 11], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request("c", [10, 11], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    eng.add_request("c", [10, 11], SamplingParams(max_tokens=2))  # room again once the queue drains
