"""The contract the GPU decode path rests on, checked on CPU: what a decode-only step does outside its CUDA graph,
how often it waits for the device, and that the graph's static inputs carry the step.

The engine runs its GPU path here (``attention_backend="triton"``: the Triton kernels under triton's interpreter,
inputs staged through ``step_inputs``) with decode graphs in eager replay (``DecodeGraphs(replay="eager")``): the
same function over the same fixed-address buffers a CUDA graph would replay. A ``TorchDispatchMode`` records every
aten op a step runs, marked by whether it ran inside the captured function. On a GPU each op is about one kernel
launch, so the count outside the graph is the step's launch budget; inside, one bucket's sequence of ops must
never change (a graph replays exactly what was captured). Host waits are counted where the engine makes them
(``HostReadback``), and ops that read a device value on the host (``.item()``, ``bool(t)``, ``nonzero``) or make
a tensor from Python data (``torch.tensor(list)``: a blocking copy on a GPU) must not occur at all.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from tests.serving.conftest import build_tiny_model

triton_attention = pytest.importorskip("serving.engine.triton_attention")
pytestmark = pytest.mark.skipif(not triton_attention.interpreted(), reason="needs triton's CPU interpreter")

# ops that make the host wait for a device value, or copy Python data to the device (both sync on a GPU)
HOST_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "lift_fresh", "lift_fresh_copy"}
OUTSIDE_GRAPH_BUDGET = 150  # the goal for a decode step of the 1B shape at 64 sequences


@pytest.fixture(scope="module")
def one_layer_model_dir(tmp_path_factory) -> Path:
    """The serving tests' tiny Llama with one decoder layer: what this module checks is the step around the model
    (its inputs, the sampler, the read back, the graph's buffers), the same for any depth, and the interpreted
    kernels cost per layer (the module: ~110 s on two layers)."""
    return build_tiny_model(tmp_path_factory.mktemp("one-layer"), layers=1)


class StepOps(TorchDispatchMode):
    """Every aten op run while active, as (inside the captured function?, op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[bool, str]] = []
        self.in_graph = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((self.in_graph, func._overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _instrument(engine: LLMEngine) -> StepOps:
    """Eager-replay decode graphs whose captured function marks the ops it runs."""
    graphs = engine.runner.enable_decode_graphs("eager")
    recorder = StepOps()
    captured = graphs.forward

    def marked(inputs):
        recorder.in_graph = True
        try:
            return captured(inputs)
        finally:
            recorder.in_graph = False

    graphs.forward = marked
    return recorder


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(**{"device": "cpu", "num_blocks": 96, "max_model_len": 64, "attention_backend": "triton",
                             **overrides})
    return LLMEngine.from_pretrained(model_dir, config)


def _decode_steps(engine: LLMEngine, recorder: StepOps, prompts: list[list[int]], params: SamplingParams,
                  steps: int) -> list[dict]:
    """Admit ``prompts``, step until every one decodes, then record ``steps`` decode-only steps."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.scheduler.waiting or engine._inbox or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    readback = engine.executor.sampler.readback(engine.runner.device)
    records = []
    for _ in range(steps):
        assert len(engine.scheduler.running) == len(prompts)
        recorder.ops, waits = [], readback.waits
        with recorder:
            engine.step()
        records.append({"outside": [op for inside, op in recorder.ops if not inside],
                        "inside": [op for inside, op in recorder.ops if inside],
                        "waits": readback.waits - waits})
    while engine.has_unfinished():
        engine.step()
    return records


def _prompts(n: int, seed: int = 0, longest: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 400) for _ in range(rng.randint(2, longest))] for _ in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_a_decode_step_waits_for_the_device_once(one_layer_model_dir, params):
    engine = _engine(one_layer_model_dir)
    recorder = _instrument(engine)
    for rec in _decode_steps(engine, recorder, _prompts(5), params, steps=3):
        assert rec["waits"] == 1  # the sampled ids
        syncs = Counter(op for op in rec["outside"] + rec["inside"] if op in HOST_SYNC_OPS)
        assert not syncs, syncs


def test_ops_outside_the_graph_fit_the_budget_and_the_graph_replays_one_sequence(one_layer_model_dir):
    """64 sequences (bucket 64). Everything the model computes runs inside the captured function, so the ops outside
    are the step's own (inputs, sampling, the read back) and do not grow with the model: this count is the 1B
    model's too, and the one-layer model's. Inside, every step of a bucket runs the same ops. (The ops inside are
    no launch count on CPU: the interpreter and the C++ norm kernels stand in for GPU kernels there; the device
    check counts the real launches with graphs on and off.)"""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = _engine(one_layer_model_dir, max_num_seqs=64, num_blocks=200, max_model_len=16)
    recorder = _instrument(engine)
    records = _decode_steps(engine, recorder, _prompts(64, seed=1, longest=3), params, steps=2)
    assert records[0]["inside"] == records[1]["inside"] and records[0]["inside"]
    assert records[0]["outside"] == records[1]["outside"]
    assert len(records[0]["outside"]) <= OUTSIDE_GRAPH_BUDGET, Counter(records[0]["outside"])


def test_decode_graphs_give_the_tokens_of_the_eager_path_and_write_no_padding(one_layer_model_dir):
    """Three sequences replay the bucket of four: the padding row must not touch the cache (every block no
    sequence owns stays as it was) and every token equals the torch reference's, greedy and seeded sampling."""
    prompts = _prompts(3, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    reference = LLMEngine.from_pretrained(one_layer_model_dir, EngineConfig(device="cpu", num_blocks=96,
                                                                       attention_backend="torch"))
    want = [o.token_ids for o in reference.generate(prompts, greedy)] + \
        [o.token_ids for o in reference.generate(prompts, seeded)]
    engine = _engine(one_layer_model_dir)
    graphs = engine.runner.enable_decode_graphs("eager")
    runs = Counter()
    replay = graphs.run

    def counted(scheduled, *rest):
        runs[graphs.bucket(len(scheduled))] += 1
        return replay(scheduled, *rest)

    graphs.run = counted
    caches = engine.runner.k_caches + engine.runner.v_caches
    for c in caches:
        c.fill_(float("nan"))  # a block nobody owns stays NaN; a stray write would make it a number
    got = [o.token_ids for o in engine.generate(prompts, greedy)] + \
        [o.token_ids for o in engine.generate(prompts, seeded)]
    assert got == want
    assert runs[4] > 0  # the padded bucket ran
    used = engine.scheduler.bm._fresh  # blocks ever handed out: ids below; the rest were never owned
    for c in caches:
        assert torch.isnan(c[used:]).all()


def test_with_a_step_in_flight_the_graph_reads_the_last_ids_on_the_device_and_each_step_waits_once(
        one_layer_model_dir):
    """Async scheduling: a decode row's input is the token the step in flight sampled, which the host has not
    seen; the runner writes it into the graph's static ids on the device before the replay (a placeholder left
    there fails the embedding lookup). Tokens equal the synchronous engine's, greedy and seeded; every decode step
    still waits once and reads no device value on the host."""
    prompts = _prompts(3, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    runs = []
    for mode in (False, True):
        engine = _engine(one_layer_model_dir, async_scheduling=mode)
        engine.runner.enable_decode_graphs("eager")
        runs.append([o.token_ids for o in engine.generate(prompts, greedy)] +
                    [o.token_ids for o in engine.generate(prompts, seeded)])
        assert engine.num_steps_overlapped == (2 * 7 if mode else 0)  # two batches of eight steps, less the last
    assert runs[1] == runs[0]
    engine = _engine(one_layer_model_dir, async_scheduling=True)
    recorder = _instrument(engine)
    for rec in _decode_steps(engine, recorder, prompts, seeded, steps=3):
        assert rec["waits"] == 1
        syncs = Counter(op for op in rec["outside"] + rec["inside"] if op in HOST_SYNC_OPS)
        assert not syncs, syncs


def test_every_index_tensor_of_a_step_is_64_byte_aligned():
    """Triton compiles a kernel again for each new alignment of its pointer arguments, so a field whose offset
    followed the step's token count would recompile kernels mid-traffic: every view starts on 64 bytes, whatever
    the mix of decodes and chunks."""
    from serving.engine.scheduled_seq import ScheduledSeq
    from serving.engine.sequence import Sequence
    from serving.engine.step_inputs import DecodeStaticInputs, StepInputBuilder

    builder = StepInputBuilder(torch.device("cpu"), 16)
    rng = random.Random(3)
    for _ in range(20):
        scheduled = []
        for i in range(rng.randint(1, 9)):
            n = 1 if i < 3 else rng.randint(1, 40)
            seq = Sequence(f"s{i}", [7] * (n + rng.randint(0, 30)), SamplingParams())
            seq.num_computed_tokens = seq.num_tokens - n
            seq.block_table = list(range(-(-seq.num_tokens // 16)))
            scheduled.append(ScheduledSeq(seq, n))
        inputs = builder.build(scheduled, [0, 2])
        for t in vars(inputs).values():
            if isinstance(t, torch.Tensor):
                assert t.data_ptr() % 64 == 0
    static = DecodeStaticInputs(torch.device("cpu"), 16, 100, 8)
    assert all(t.data_ptr() % 64 == 0 for t in (static.ids, static.positions, static.slots, static.lens,
                                                 static.tables))
