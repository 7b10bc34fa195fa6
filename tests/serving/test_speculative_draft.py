"""Speculative decoding with a draft model: the greedy output token for token whatever the draft guesses,
fewer steps when it guesses well, its own KV blocks always returned, a draft of another vocabulary refused;
with the n-gram lookup first (the default), the lookup's guesses where the context repeats and the draft's
elsewhere, the draft's state kept across the lookup's steps."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.cli import main
from serving.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from serving.engine.draft_model import DraftModelProposer
from serving.engine.speculative import LookupThenDraft, NgramProposer
from tests.serving.test_api_server import MODEL, running_server
from tests.serving.test_speculative import PROMPTS, assert_stop_rules_match

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _engine(model_dir: Path, draft: Path | None = None, k: int = 4, lookup: bool = False, **kw) -> LLMEngine:
    """An engine speculating with ``draft`` alone (``lookup``: with the n-gram lookup first, as served)."""
    kw = {"num_blocks": 256, "block_size": 8, **kw}
    return LLMEngine.from_pretrained(model_dir, EngineConfig(speculative_tokens=k if draft else 0,
                                                             speculative_model=str(draft) if draft else None,
                                                             speculative_lookup=lookup, **kw))


def _pass_cost_fixed(engine: LLMEngine, ratio: float = 0.35) -> LLMEngine:
    """These engines are judged on tokens, acceptance, lookahead and steps. How many guesses a draft pass is
    worth also follows its measured wall-clock cost, which load on a shared machine moves (a loaded host
    measured a self-draft's pass above a target step's and stopped guessing). That rule has its own tests
    (``test_speculative.py``, and the costly-draft test below), so here a pass costs what it measures on a
    quiet host for these pairs, about a third of a target step, and is not measured again."""
    proposer = engine.proposer
    draft = proposer.draft if isinstance(proposer, LookupThenDraft) else proposer
    draft.budget.cost_ratio, draft.budget.warmup = ratio, 10**9
    return engine


def _draft_blocks_all_free(engine: LLMEngine) -> bool:
    draft = getattr(engine.proposer, "draft", engine.proposer)
    bm = draft.block_manager
    return not draft.drafts and bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def micro_1layer_dir(micro_base_dir, tmp_path_factory) -> Path:
    """The pretrained micro model with its second layer cut off: a smaller draft of the same tokenizer that
    agrees with the full model often, not always (both accepted and rejected guesses happen)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("micro-1layer")
    model = AutoModelForCausalLM.from_pretrained(micro_base_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(micro_base_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def plain(micro_base_dir) -> LLMEngine:
    return _engine(micro_base_dir)


@pytest.fixture(scope="module")
def self_draft(micro_base_dir) -> LLMEngine:
    return _pass_cost_fixed(_engine(micro_base_dir, draft=micro_base_dir))


@pytest.fixture(scope="module")
def small_draft(micro_base_dir, micro_1layer_dir) -> LLMEngine:
    return _pass_cost_fixed(_engine(micro_base_dir, draft=micro_1layer_dir))


@pytest.fixture(scope="module")
def lookup_then_draft(micro_base_dir, micro_1layer_dir) -> LLMEngine:
    engine = _engine(micro_base_dir, draft=micro_1layer_dir, lookup=True)
    assert isinstance(engine.proposer, LookupThenDraft)
    return _pass_cost_fixed(engine)


@pytest.mark.parametrize("draft", ["micro_1layer_dir", "tiny_model_dir"])
def test_guesses_are_the_drafts_own_greedy_continuation_after_any_history(request, draft):
    """The proposer alone, driven as the engine drives it: after guesses kept, rejected or cut short, its
    guesses are what the draft model generates greedily from the same tokens (its cache kept only what
    still agrees), and a request missing from a step is released. The random-init tiny model's argmax
    depends on the whole context, so a stale KV entry shows."""
    from serving.engine.sequence import Sequence

    draft_dir = request.getfixturevalue(draft)
    k = 4
    config = EngineConfig(num_blocks=64, block_size=8, speculative_tokens=k, max_num_batched_tokens=16)
    draft_alone = _engine(draft_dir)
    vocab = draft_alone.runner.vocab_size
    proposer = DraftModelProposer(draft_dir, config, vocab, draft_alone.tokenizer, num_blocks=64)

    def continuation(tokens: list[int], n: int = k) -> list[int]:
        (out,) = draft_alone.generate([tokens], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return out.token_ids

    a = Sequence("a", draft_alone.encode(PROMPTS[0]), GREEDY)  # over 16 tokens: caught up over several steps
    b = Sequence("b", draft_alone.encode(PROMPTS[4])[:12], GREEDY)
    assert a.num_tokens > 16 + 15
    assert proposer.propose_many([a, b], [k, k]) == {"b": continuation(b.token_ids)}
    steps = 1
    while True:
        steps += 1
        guesses = proposer.propose_many([a, b], [k, 2])
        if "a" in guesses or steps > a.num_tokens:
            break
    assert steps == 1 + -(-(a.num_tokens - 4) // 15)  # 4 tokens beside b's 12, then 15 a step beside b's one
    assert guesses == {"a": continuation(a.token_ids), "b": continuation(b.token_ids, 2)}
    # the target keeps `kept` guesses, then adds tokens of its own, the first unlike the next guess (the engine
    # adds one; two leave a rejected guess's KV below the newest token, which must not be reused)
    for kept, own in ((k, 1), (1, 1), (0, 2), (2, 1), (1, 3)):
        g = guesses["a"]
        a.token_ids += g[:kept] + [(g[kept] + 1) % vocab if kept < len(g) else 7] + [42] * (own - 1)
        guesses = proposer.propose_many([a], [k])
        assert guesses == {"a": continuation(a.token_ids)}, (kept, own)
        assert "b" not in proposer.drafts  # left the step's decodes: released
    proposer.release("a")
    assert not proposer.drafts and proposer.block_manager.num_free_blocks == 64


def test_the_target_as_its_own_draft_has_every_guess_accepted(plain, self_draft):
    assert isinstance(self_draft.proposer, DraftModelProposer)
    steps = (plain.num_steps, self_draft.num_steps)
    before = (self_draft.speculation.drafted, self_draft.speculation.accepted, self_draft.speculation.steps)
    for prompt in PROMPTS:  # batch 1
        (a,), (b,) = plain.generate([prompt], GREEDY), self_draft.generate([prompt], GREEDY)
        assert (b.token_ids, b.text) == (a.token_ids, a.text), prompt
    drafted = self_draft.speculation.drafted - before[0]
    accepted = self_draft.speculation.accepted - before[1]
    assert drafted > 0 and accepted / drafted >= 0.98
    # every guess kept, so the adaptive lookahead stays at k (fewer only in a reply's last steps)
    assert drafted / (self_draft.speculation.steps - before[2]) >= 3.5
    # k=4: up to 5 tokens a step, against one
    assert (self_draft.num_steps - steps[1]) * 3 < plain.num_steps - steps[0]
    assert _draft_blocks_all_free(self_draft)


def test_a_smaller_draft_changes_no_token_at_batch_1_or_batched(plain, small_draft):
    before = (small_draft.speculation.drafted, small_draft.speculation.accepted, small_draft.speculation.steps)
    for prompt in PROMPTS:
        (a,), (b,) = plain.generate([prompt], GREEDY), small_draft.generate([prompt], GREEDY)
        assert (b.token_ids, b.text) == (a.token_ids, a.text), prompt
    drafted = small_draft.speculation.drafted - before[0]
    accepted = small_draft.speculation.accepted - before[1]
    assert 0 < accepted < drafted  # a real draft: some guesses kept, some rejected
    # after rejections the engine asks this draft for fewer than k guesses (each one is a draft pass)
    assert drafted / (small_draft.speculation.steps - before[2]) < 3.5
    # batched with requests that cannot speculate: a seeded sampled one and a greedy one with logprobs
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=32, ignore_eos=True), GREEDY]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    drafted = small_draft.speculation.drafted
    want, got = plain.generate(prompts, params), small_draft.generate(prompts, params)
    assert small_draft.speculation.drafted > drafted
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    for lp_got, lp_want in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert lp_got == pytest.approx(lp_want, abs=1e-4)
    assert _draft_blocks_all_free(small_draft)


def test_lookup_then_draft_guesses_from_the_context_where_it_repeats_and_from_the_draft_elsewhere(
        micro_1layer_dir):
    """The combined proposer alone, driven as the engine drives it: a context that repeats gets the lookup's
    guesses, one that does not gets the draft's; the draft keeps a request's cache and lookahead while the
    lookup guesses for it, and learns only from its own guesses."""
    from serving.engine.sequence import Sequence

    k = 4
    config = EngineConfig(num_blocks=64, block_size=8, speculative_tokens=k)
    draft_alone = _engine(micro_1layer_dir)
    lookup = NgramProposer(k)
    proposer = LookupThenDraft(lookup, DraftModelProposer(micro_1layer_dir, config, draft_alone.runner.vocab_size,
                                                          draft_alone.tokenizer, num_blocks=64))

    def continuation(tokens: list[int], n: int = k) -> list[int]:
        (out,) = draft_alone.generate([tokens], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return out.token_ids

    fresh = [11, 12, 13, 14, 15, 16, 17, 18]  # nothing repeats: only the draft can guess
    a = Sequence("a", list(fresh), GREEDY)
    assert lookup.propose(a.token_ids, k) == []
    assert proposer.propose_many([a], [k]) == {"a": continuation(a.token_ids)}
    proposer.observe("a", drafted=k, kept=0)  # all rejected: the draft is asked for fewer next time
    assert proposer.draft.drafts["a"].lookahead == k - 1
    a.token_ids += [40, 41, 42, 43, 44, 12, 13]  # "12 13" occurred before: the lookup guesses "14 15 16 17"
    assert proposer.propose_many([a], [k]) == {"a": [14, 15, 16, 17]}
    proposer.observe("a", drafted=k, kept=0)  # the lookup's miss is not the draft's
    assert "a" in proposer.draft.drafts and proposer.draft.drafts["a"].lookahead == k - 1
    a.token_ids += [50]  # the repeat ended: back to the draft, which catches up on the tokens it missed
    assert proposer.propose_many([a], [k]) == {"a": continuation(a.token_ids, k - 1)}
    assert proposer.propose_many([], []) == {} and not proposer.draft.drafts  # gone from the step: released
    assert proposer.draft.block_manager.num_free_blocks == 64


def test_a_draft_costlier_than_a_target_step_is_asked_for_nothing_but_rare_measurement_passes(micro_1layer_dir):
    """The proposer alone, told (as the engine tells it after each step) that the target's forward took far
    less than the draft's passes: no share of guesses kept could pay, so a request gets no guesses except a
    measurement pass after ``MAX_MEASURE_EVERY`` steps, which times the draft again."""
    from serving.engine.draft_model import MAX_MEASURE_EVERY
    from serving.engine.sequence import Sequence

    k = 4
    config = EngineConfig(num_blocks=64, block_size=8, speculative_tokens=k)
    draft_alone = _engine(micro_1layer_dir)
    proposer = DraftModelProposer(micro_1layer_dir, config, draft_alone.runner.vocab_size, draft_alone.tokenizer,
                                  num_blocks=64)
    a = Sequence("a", draft_alone.encode(PROMPTS[4])[:6], GREEDY)

    def step(target_seconds: float) -> list[int]:
        guesses = proposer.propose_many([a], [k]).get("a", [])
        proposer.observe_step(target_seconds)
        if guesses:
            proposer.observe("a", drafted=len(guesses), kept=len(guesses))  # every guess kept
        a.token_ids.append(guesses[0] if guesses else 9)
        return guesses

    for _ in range(2):  # warming up, then a measured step: a pass costs 10**4 x a "target step"
        assert len(step(1e-8)) == k
    assert proposer.budget.cost_ratio > 1.0
    counts = [len(step(1e-8)) for _ in range(MAX_MEASURE_EVERY - 1)]
    assert counts == [0] * (MAX_MEASURE_EVERY - 1)
    before = proposer.budget.cost_ratio
    assert len(step(10.0)) == 2  # the measurement pass: a catch-up over the missed tokens and one decode-sized pass
    assert proposer.budget.cost_ratio < before  # measured again, against a slow target this time


def test_lookup_then_draft_changes_no_token_and_takes_more_per_step_on_repeats(plain, small_draft,
                                                                             lookup_then_draft):
    """Batch 1 and batched, the output of plain greedy; on prompts that repeat their context the combined
    proposer emits more tokens per target step than the draft alone."""
    repeats = PROMPTS[:3]
    steps = {}
    for name, spec in (("draft", small_draft), ("both", lookup_then_draft)):
        before = spec.num_steps
        for prompt in repeats:
            (a,), (b,) = plain.generate([prompt], GREEDY), spec.generate([prompt], GREEDY)
            assert (b.token_ids, b.text) == (a.token_ids, a.text), (name, prompt)
        steps[name] = spec.num_steps - before
    assert steps["both"] < steps["draft"], steps
    assert [o.token_ids for o in lookup_then_draft.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert _draft_blocks_all_free(lookup_then_draft)


@pytest.mark.parametrize("which", ["self", "small", "lookup"])
def test_stop_rules_apply_inside_an_accepted_guess(plain, self_draft, small_draft, lookup_then_draft, which):
    spec = {"self": self_draft, "small": small_draft, "lookup": lookup_then_draft}[which]
    assert_stop_rules_match(plain, spec)
    assert _draft_blocks_all_free(spec)


def test_an_aborted_request_returns_its_draft_blocks(small_draft):
    tokens = small_draft.encode(PROMPTS[0])
    small_draft.add_request("to-abort", tokens, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    for _ in range(20):
        small_draft.step()
        if small_draft.proposer.drafts:
            break
    assert "to-abort" in small_draft.proposer.drafts and not _draft_blocks_all_free(small_draft)
    small_draft.abort("to-abort")
    (out,) = small_draft.step()
    assert out.finished and out.finish_reason == "abort"
    assert _draft_blocks_all_free(small_draft)


@pytest.mark.parametrize("lookup", [False, True])
def test_preemption_and_a_chunked_catch_up_change_no_token(plain, micro_base_dir, micro_1layer_dir, lookup):
    """A target cache too small for four sequences preempts some (their draft state is dropped and rebuilt),
    and a step budget of 16 tokens makes the draft catch up on a long prompt over several steps."""
    want = plain.generate(PROMPTS[:4], GREEDY)
    spec = _pass_cost_fixed(_engine(micro_base_dir, draft=micro_1layer_dir, lookup=lookup, num_blocks=16,
                                    max_num_batched_tokens=16))
    got = spec.generate(PROMPTS[:4], GREEDY)
    assert spec.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.speculation.accepted > 0
    assert _draft_blocks_all_free(spec)


def test_a_tiny_draft_cache_gives_fewer_guesses_and_the_same_output(plain, small_draft, micro_base_dir,
                                                                      micro_1layer_dir):
    prompts = ["Hello world!", "The quick brown fox", "Once upon a time"]
    want = plain.generate(prompts, GREEDY)
    # both at the same fixed pass cost: the count of guesses is then set by the draft's room alone (with the cost
    # measured, a loaded host once stopped the roomy one guessing after six steps, 22 guesses against 31)
    roomy = _pass_cost_fixed(_engine(micro_base_dir, draft=micro_1layer_dir))
    roomy.generate(prompts, GREEDY)
    tiny = _engine(micro_base_dir, draft=micro_1layer_dir)
    # 4 blocks of 8 tokens: room for one or two short contexts, never for all three to the end
    tiny.scheduler.speculator.proposer = DraftModelProposer(micro_1layer_dir, tiny.config, tiny.runner.vocab_size,
                                                            tiny.tokenizer, num_blocks=4)
    _pass_cost_fixed(tiny)
    got = tiny.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)
    assert 0 < tiny.speculation.drafted < roomy.speculation.drafted
    assert _draft_blocks_all_free(tiny)


@pytest.mark.parametrize("lookup", [False, True])
def test_a_failing_draft_costs_guesses_never_a_request(plain, micro_base_dir, micro_1layer_dir, lookup):
    prompts = PROMPTS[:3]
    want = plain.generate(prompts, GREEDY)
    spec = _pass_cost_fixed(_engine(micro_base_dir, draft=micro_1layer_dir, lookup=lookup))
    runner = getattr(spec.proposer, "draft", spec.proposer).runner
    real_execute = runner.execute
    faults = []

    def execute(items, flags, verify=None):
        # a fault injected on purpose: the draft's forward raises whenever the second request is in its batch
        if any(item.seq.request_id.endswith("-1") for item in items):
            faults.append(len(items))
            raise RuntimeError("injected draft fault")
        return real_execute(items, flags, verify)

    runner.execute = execute
    got = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" and o.outputs[0].finish_reason == "length" for o in got)
    assert any(n > 1 for n in faults)  # it failed in a batch with the others, who still got their guesses
    assert spec.speculation.accepted > 0 and spec.requests_failed_total == 0
    assert _draft_blocks_all_free(spec)


# ----------------------------------------------------------------------------- refusing a wrong draft
def _other_tokenizer_same_size(micro_base_dir: Path, out: Path) -> Path:
    """micro with two of its tokens' ids swapped: the same vocab_size, another tokenizer."""
    shutil.copytree(micro_base_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_a_draft_of_another_vocabulary_refuses_to_load(micro_base_dir, tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=f"speculative model {re.escape(str(tiny_model_dir))}: .*vocab"):
        _engine(micro_base_dir, draft=tiny_model_dir)
    swapped = _other_tokenizer_same_size(micro_base_dir, tmp_path / "swapped")
    with pytest.raises(ModelLoadError, match=f"speculative model {re.escape(str(swapped))}: its tokenizer differs "
                                             r".*\(2 of \d+ tokens"):
        _engine(micro_base_dir, draft=swapped)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match=f"speculative model: {re.escape(str(nowhere))}: not a model dir"):
        _engine(micro_base_dir, draft=nowhere)
    with pytest.raises(ValueError, match="speculative_model: needs speculative_tokens >= 1"):
        EngineConfig(speculative_model=str(micro_base_dir))


def test_serve_flags_map_and_a_bad_draft_is_one_line(micro_base_dir, tmp_path, capsys):
    from serving.cli import engine_config_from_args
    from serving.deploy import build_parser

    args = build_parser().parse_args(["snapshot", "bundle", "--standalone", "--speculative-model",
                                      str(micro_base_dir), "--speculative-tokens", "3"])
    cfg = engine_config_from_args(args)  # `deploy snapshot --standalone` shares the serve flags
    assert (cfg.speculative_model, cfg.speculative_tokens, cfg.speculative_lookup) == (str(micro_base_dir), 3, True)
    args = build_parser().parse_args(["snapshot", "bundle", "--standalone", "--speculative-model",
                                      str(micro_base_dir), "--speculative-tokens", "3", "--no-speculative-lookup"])
    assert engine_config_from_args(args).speculative_lookup is False
    assert main(["serve", str(micro_base_dir), "--speculative-model", str(tmp_path / "nowhere"),
                 "--speculative-tokens", "4"]) == 2
    assert main(["serve", str(micro_base_dir), "--speculative-model", str(micro_base_dir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert "--speculative-model" in err[0] and "config.json missing" in err[0]
    assert "speculative_tokens >= 1" in err[1]


def test_lifecycle_serve_refuses_a_mismatched_draft_in_one_line(micro_base_dir, tiny_model_dir):
    """The real command, with the engine in its own process (the default): the core's load failure comes back
    as one `error:` line and exit status 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", str(micro_base_dir), "--port", "1",
                           "--threads", "1", "--speculative-tokens", "4", "--speculative-model", str(tiny_model_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and str(tiny_model_dir) in errors[0] and "vocab" in errors[0], errors
    assert "Traceback" not in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------- through HTTP
def _spec_counters(base: str) -> tuple[float, float]:
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
               for s in f.samples}
    return (samples["vllm:spec_decode_num_draft_tokens_total"],
            samples["vllm:spec_decode_num_accepted_tokens_total"])


def test_http_replies_equal_plain_and_metrics_count_the_guesses(micro_base_dir, micro_1layer_dir):
    body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    plain_cfg = EngineConfig(num_blocks=128, block_size=8, max_num_seqs=4)
    spec_cfg = EngineConfig(num_blocks=128, block_size=8, max_num_seqs=4, speculative_tokens=4,
                            speculative_model=str(micro_1layer_dir))
    with running_server(micro_base_dir, plain_cfg) as (base, _):
        want = [httpx.post(f"{base}/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                for p in PROMPTS[:3]]
    # the engine in its own process, as `lifecycle serve` runs it: the config crosses over with the draft
    with running_server(micro_base_dir, spec_cfg, "process") as (base, _):
        seen = [_spec_counters(base)]
        for prompt, reference in zip(PROMPTS[:3], want):
            r = httpx.post(f"{base}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == reference["choices"][0]["text"], prompt
            seen.append(_spec_counters(base))
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
        cost = families["vllm:spec_decode_draft_cost_ratio"].samples[0].value
        assert 0 < cost < 10, cost  # what the engine measured a draft pass at, against a target step
    for before, after in zip(seen, seen[1:]):
        assert after[0] > before[0] and after[1] > before[1]  # drafted and accepted rise with every request
