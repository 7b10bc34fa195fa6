"""Scheduler: token budget, chunked prefill, decode priority, preemption by recompute, queue limits; applying a
step's output (tokens, finishes, errors)."""

from __future__ import annotations

import pytest

from serving.engine.config import EngineConfig
from serving.engine.outputs import ModelOutput, RequestOutput
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(config, num_blocks, max_model_len=num_blocks * block_size)


def seq(rid: str, n: int, arrival: float, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=64), arrival_time=arrival)


def planned(out: SchedulerOutput) -> dict[str, int]:
    """The plan as ``{request_id: num_tokens}``, in the order it was made."""
    return {item.seq.request_id: item.num_tokens for item in out.scheduled}


def execute(sched: Scheduler, out: SchedulerOutput, sampled_token: int = 1) -> list[RequestOutput]:
    """Stand-in for the executor: a sequence that finishes its prefill in this step samples ``sampled_token``;
    the scheduler moves the plan on at its launch and applies the result as it does a real step's."""
    flags = [item.seq.num_computed_tokens + item.num_tokens == item.seq.num_tokens for item in out.scheduled]
    sampled = {i: (sampled_token, None) for i, flag in enumerate(flags) if flag}
    sched.launched(out, flags)
    return sched.update_from_output(out, ModelOutput(flags, sampled=sampled))


def test_budget_limits_tokens_per_step_and_chunks_long_prompts():
    sched = make(max_num_batched_tokens=16)
    long = seq("long", 40, 0.0)
    sched.add(long)
    out = sched.schedule()
    assert planned(out) == {"long": 16}
    assert execute(sched, out) == []  # a prompt chunk outputs nothing
    assert long.num_computed_tokens == 16
    assert planned(sched.schedule()) == {"long": 16}


def test_long_prompt_does_not_stall_running_decodes():
    sched = make(max_num_batched_tokens=16)
    short = seq("short", 3, 0.0)
    sched.add(short)
    execute(sched, sched.schedule())  # short prefilled, now decoding
    sched.add(seq("long", 100, 1.0, start=500))
    for _ in range(4):
        out = sched.schedule()
        plan = planned(out)
        assert plan["short"] == 1  # every step, the decode runs
        assert plan["long"] == 15  # the prompt takes what is left of the budget
        assert sum(plan.values()) <= 16
        assert [o.request_id for o in execute(sched, out)] == ["short"]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = seq("a", 10, 0.0), seq("b", 10, 1.0, start=100)
    sched.add(a)
    sched.add(b)
    assert planned(sched.schedule()) == {"a": 10}  # b does not fit the rest of the budget, whole or not


def test_max_num_seqs_caps_the_running_batch():
    sched = make(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(f"s{i}", 3, float(i), start=10 * i))
    assert set(planned(sched.schedule())) == {"s0", "s1"}
    assert len(sched.waiting) == 2


def test_admission_waits_for_free_blocks():
    sched = make(num_blocks=4, block_size=4)
    sched.add(seq("a", 12, 0.0))
    sched.add(seq("b", 8, 1.0, start=100))
    assert set(planned(sched.schedule())) == {"a"}  # a holds 3 of 4 blocks; b needs 2
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
    assert planned(out) == {"a": 1}
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.token_ids[-1] == 1  # its output token is kept; it will be recomputed, not resampled
    assert sched.num_preemptions == 1 and sched.waiting[0] is b


def test_finished_sequences_leave_and_free_blocks_in_that_step():
    sched = make(num_blocks=8)
    a = Sequence("a", list(range(9)), SamplingParams(max_tokens=2), arrival_time=0.0)
    sched.add(a)
    (first,) = execute(sched, sched.schedule())
    assert not first.finished and first.delta_token_ids == [1]
    assert sched.bm.num_used_blocks == 3
    (last,) = execute(sched, sched.schedule(), sampled_token=2)
    assert last.finished and last.finish_reason == "length" and last.token_ids == [1, 2]
    assert sched.bm.usage() == 0.0 and not sched.has_unfinished()
    assert sched.finished_ids == ["a"] and "a" not in sched.requests


def test_stop_rules_end_a_sequence_on_the_token_that_meets_them():
    sched = make()
    stop_id = Sequence("id", [5, 6], SamplingParams(max_tokens=8, stop_token_ids=[7]), arrival_time=0.0)
    early = Sequence("eos", [5, 6], SamplingParams(max_tokens=8, min_tokens=2), eos_token_ids=frozenset({7}),
                     arrival_time=1.0)
    for s in (stop_id, early):
        sched.add(s)
    outs = execute(sched, sched.schedule(), sampled_token=7)
    assert [(o.request_id, o.finished) for o in outs] == [("id", True), ("eos", False)]
    assert outs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == 7
    (out,) = execute(sched, sched.schedule(), sampled_token=7)  # eos counts once min_tokens are out
    assert out.finished and out.finish_reason == "stop" and out.token_ids == [7, 7]
    assert sched.bm.usage() == 0.0 and sched.generation_tokens_total == 3


def test_an_error_from_the_executor_fails_that_sequence_alone():
    sched = make()
    a, b = seq("a", 3, 0.0), seq("b", 3, 1.0, start=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.launched(out, [True, True])
    outs = sched.update_from_output(out, ModelOutput([True, True], sampled={1: (9, None)},
                                                      errors={0: RuntimeError("boom")}))
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "error"), ("b", False, None)]
    assert outs[0].error == "RuntimeError: boom" and sched.requests_failed_total == 1
    assert sched.running == [b] and b.token_ids[-1] == 9 and b.num_computed_tokens == 3


def test_abort_finishes_a_waiting_or_running_request_and_frees_its_blocks():
    sched = make()
    a, b = seq("a", 5, 0.0), seq("b", 5, 1.0, start=100)
    sched.add(a)
    execute(sched, sched.schedule())
    sched.add(b)
    assert sched.abort("a").finish_reason == "abort" and sched.abort("b").finish_reason == "abort"
    assert sched.abort("a") is None  # gone already
    assert sched.bm.usage() == 0.0 and not sched.has_unfinished() and sched.finished_ids == ["a", "b"]


def test_priority_then_arrival_orders_admission():
    sched = make(max_num_seqs=1)
    late_urgent = seq("urgent", 3, 5.0)
    late_urgent.priority = -1
    sched.add(seq("early", 3, 0.0, start=50))
    sched.add(late_urgent)
    assert list(planned(sched.schedule())) == ["urgent"]


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
