"""The sampled probes' paired gate: draws compared one by one under shared seeds, prompts as clusters.

Pure statistics on planted outcomes (no server): the rollouts that run these probes through real replicas are in
test_rollout_trust.py and the calibration (benchmarks/rollout_calibration.py)."""

from __future__ import annotations

import random

import pytest

from serving.rollout import judge
from serving.rollout.analysis import probe_verdicts
from serving.rollout.paired_rates import UNANSWERED, pair_draws, paired_rate_gate
from serving.rollout.plan import Gates
from serving.rollout.probes import ProbeScore, pool_sampled

ALPHA = 0.05 / 6  # the default plan's level per look
PER_PROMPT = 4  # draws per task prompt: the default plan's until it took 8 (the docs' worked figures are at 4)
MARGIN = Gates().max_accuracy_drop


def _champion(seed: int = 0, prompts: int = 40, right: float = 0.45) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.random() < right) for _ in range(prompts * PER_PROMPT)]


def _judge(candidate: list[int], champion: list[int]) -> judge.Verdict:
    draws = pair_draws(candidate, champion, PER_PROMPT)
    assert draws is not None
    return paired_rate_gate("probe_sampled_accuracy", draws, margin=MARGIN, alpha=ALPHA, min_samples=10,
                            label="wrong sampled answers")


def _unpaired(candidate: list[int], champion: list[int]) -> judge.Verdict:
    n = len(champion)
    return judge.rate_gate("probe_sampled_accuracy", n - sum(candidate), n, n - sum(champion), n, margin=MARGIN,
                           alpha=ALPHA, min_samples=10, label="wrong sampled answers")


def test_an_unchanged_model_drawing_the_same_answers_passes_and_says_what_it_could_have_failed() -> None:
    champion = _champion()
    verdict = _judge(list(champion), champion)
    assert verdict.outcome == "pass" and verdict.candidate == verdict.baseline
    assert "0 wrong on the candidate alone and 0 on the champion alone" in verdict.reason
    # no spread at all, yet the look claims no more than 160 draws can show: an increase of ~+0.14
    assert MARGIN < verdict.detectable < 0.2


def test_a_loss_spread_over_many_prompts_fails_on_the_same_draws_where_two_rates_cannot_tell() -> None:
    """+0.125 wrong: one right draw of each of 20 prompts turned wrong. Compared as two independent samples of
    160 the loss hides in the noise of two draws; draw by draw it is 20 discordant draws and none the other way."""
    champion = _champion()
    candidate = list(champion)
    first_right = {}
    for draw, right in enumerate(champion):
        if right:
            first_right.setdefault(draw // PER_PROMPT, draw)
    for draw in list(first_right.values())[:20]:
        candidate[draw] = 0
    assert _unpaired(candidate, champion).outcome == "inconclusive"
    verdict = _judge(candidate, champion)
    assert verdict.outcome == "fail", verdict.reason
    assert "20 wrong on the candidate alone and 0 on the champion alone" in verdict.reason


def test_a_loss_confined_to_a_few_prompts_is_evidence_about_those_prompts_not_proof() -> None:
    """The same +0.125 from 5 prompts losing all 4 of their draws: prompts are the clusters, and 5 of 40 prompts
    moving is not significant; counted as 160 independent pairs it would have read p ≈ 0.0003."""
    champion = [1] * 20 + _champion()[20:]
    candidate = [0] * 20 + champion[20:]
    verdict = _judge(candidate, champion)
    assert verdict.outcome == "inconclusive", verdict.reason
    assert verdict.candidate - verdict.baseline == pytest.approx(0.125)


def test_a_small_real_change_within_the_tolerance_passes_in_both_directions() -> None:
    champion = _champion()
    candidate = list(champion)
    for draw in (3, 50, 97):  # three draws of three prompts differ: +0.006, -0.006, ...
        candidate[draw] = 1 - candidate[draw]
    assert _judge(candidate, champion).outcome == "pass"


def test_draws_either_side_left_unanswered_are_left_out_of_the_pairs() -> None:
    champion = _champion()
    candidate = list(champion)
    candidate[:8] = [UNANSWERED] * 8  # the candidate lost two prompts' draws to errors
    champion_with_gap = list(champion)
    champion_with_gap[100] = UNANSWERED
    draws = pair_draws(candidate, champion_with_gap, PER_PROMPT)
    assert draws.n == 160 - 9 and draws.prompts == 38
    assert _judge(candidate, champion_with_gap).outcome == "pass"
    nothing = pair_draws([UNANSWERED] * 8, _champion(prompts=2), PER_PROMPT)
    verdict = paired_rate_gate("probe_sampled_accuracy", nothing, margin=MARGIN, alpha=ALPHA, min_samples=5,
                               label="wrong sampled answers")
    assert verdict.outcome == "inconclusive" and "too few paired draws" in verdict.reason


def test_the_gate_pairs_the_probe_scores_and_falls_back_to_two_rates_for_states_without_draws() -> None:
    def score(draws: list[int]) -> dict:
        return ProbeScore(tasks=40, correct=40, formatted=40, sampled=len(draws), sampled_correct=sum(draws),
                          sampled_draws=draws, samples_per_prompt=PER_PROMPT).to_json()

    champion = _champion()
    candidate = [0 if draw % 8 == 0 else right for draw, right in enumerate(champion)]  # a loss over 20 prompts
    paired = {v.gate: v for v in probe_verdicts({"candidate": score(candidate), "champion": score(champion)},
                                                Gates(), ALPHA)}["probe_sampled_accuracy"]
    assert paired.threshold.endswith("(paired draws)")
    assert paired.outcome == _judge(candidate, champion).outcome
    old = [{k: v for k, v in score(d).items() if k not in ("sampled_draws", "samples_per_prompt")}
           for d in (candidate, champion)]
    unpaired = {v.gate: v for v in probe_verdicts({"candidate": old[0], "champion": old[1]},
                                                  Gates(), ALPHA)}["probe_sampled_accuracy"]
    assert "paired" not in unpaired.threshold
    assert unpaired.outcome == _unpaired(candidate, champion).outcome


def _coupled_rollouts(increase: float, trials: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Probe draws as the shared seeds make them: each prompt has its own chance of a right answer, each draw one
    uniform number both sides use, the candidate right on a share ``increase`` fewer of them (every prompt's chance
    is in 0.1-0.9, so the true increase of the wrong rate is exactly ``increase``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(trials):
        champion, candidate = [], []
        for _prompt in range(40):
            right = rng.uniform(0.1, 0.9)
            for _draw in range(PER_PROMPT):
                u = rng.random()
                champion.append(int(u < right))
                candidate.append(int(u < right - increase))
        out.append((candidate, champion))
    return out


def test_at_the_tolerance_the_gate_fails_no_more_than_alpha_and_a_real_loss_far_more_often_than_two_rates() -> None:
    """The level and the power, by simulation of coupled draws: a candidate exactly at the tolerance (+0.05) is
    failed at most alpha of the time at one look; +0.15 is failed at least 9 times in 10 by the paired test, where
    the two-rate test fails it about one time in seven (0.135 with these seeds)."""
    at_margin = [_judge(c, b).outcome for c, b in _coupled_rollouts(MARGIN, 300, seed=3)]
    assert at_margin.count("fail") / 300 <= ALPHA + 0.01
    lost = _coupled_rollouts(0.15, 200, seed=4)
    paired = [_judge(c, b).outcome for c, b in lost]
    unpaired = [_unpaired(c, b).outcome for c, b in lost]
    assert paired.count("fail") / 200 >= 0.9 and "pass" not in paired
    assert unpaired.count("fail") / 200 < 0.25


def _score(draws: list[int], looks: int = 1, prompts: int = 40) -> dict:
    answered = [d for d in draws if d != UNANSWERED]
    return ProbeScore(tasks=prompts, correct=prompts, formatted=prompts, sampled=len(answered),
                      sampled_correct=sum(answered), sampled_errors=len(draws) - len(answered),
                      sampled_draws=draws, samples_per_prompt=PER_PROMPT, sampled_prompts=prompts,
                      sampled_looks=looks).to_json()


def test_a_looks_sampled_draws_pool_with_the_earlier_looks_and_keep_their_prompts() -> None:
    first, second = _champion(seed=1), _champion(seed=2)
    second[5] = UNANSWERED
    pooled = pool_sampled(_score(first), _score(second))
    assert pooled["sampled_draws"] == first + second and pooled["sampled_looks"] == 2
    assert pooled["sampled"] == 319 and pooled["sampled_errors"] == 1
    assert pooled["sampled_correct"] == (first + second).count(1)
    assert pooled["correct"] == 40  # the greedy probes repeat the last look's answers: not pooled
    third = pool_sampled(pooled, _score(_champion(seed=3)))
    assert third["sampled_looks"] == 3 and len(third["sampled_draws"]) == 480
    # a draw belongs to its prompt at every look: 40 prompts of 12 paired draws, not 120 prompts of 4
    draws = pair_draws(third["sampled_draws"], third["sampled_draws"], PER_PROMPT, 40)
    assert draws.prompts == 40 and set(draws.pairs) == {11, 12} and draws.looks == 3
    # drawn otherwise (another probe set, or draws per prompt), the earlier draws are not pooled
    other = _score(_champion(seed=4, prompts=30), prompts=30)
    assert pool_sampled(pooled, other) is other


def test_the_pooled_gate_says_how_many_looks_it_judged() -> None:
    champion = [_champion(seed=s) for s in (1, 2)]
    candidate = [list(c) for c in champion]
    scores = {side: pool_sampled(_score(draws[0]), _score(draws[1]))
              for side, draws in (("champion", champion), ("candidate", candidate))}
    verdict = {v.gate: v for v in probe_verdicts(scores, Gates(), ALPHA)}["probe_sampled_accuracy"]
    assert verdict.outcome == "pass" and verdict.samples == 320
    assert "320 draws of 40 prompts over 2 looks" in verdict.reason


def _rollout_of_looks(increase: float, looks: int, pooled: bool, rng: random.Random) -> str:
    """One rollout's sampled gate over ``looks`` looks (the default plan's shadow phase: a look, one extension):
    the prompts' chances fixed, fresh coupled draws at every look, judged on that look's draws alone or on all so
    far. The first pass or fail decides; inconclusive at the last look pauses."""
    chances = [rng.uniform(0.1, 0.9) for _ in range(40)]
    candidate: list[int] = []
    champion: list[int] = []
    for _look in range(looks):
        c, b = [], []
        for right in chances:
            for _draw in range(PER_PROMPT):
                u = rng.random()
                b.append(int(u < right))
                c.append(int(u < right - increase))
        candidate, champion = (candidate + c, champion + b) if pooled else (c, b)
        draws = pair_draws(candidate, champion, PER_PROMPT, 40)
        outcome = paired_rate_gate("probe_sampled_accuracy", draws, margin=MARGIN, alpha=ALPHA, min_samples=10,
                                   label="wrong sampled answers").outcome
        if outcome != "inconclusive":
            return outcome
    return "paused"


def test_pooled_looks_take_away_the_second_chance_a_mild_loss_got_from_fresh_draws() -> None:
    """By simulation over the default plan's two shadow looks: judged look by look, a loss of +0.10 (twice the
    tolerance) is rolled back about half the time and +0.074 is promoted about one time in four (fresh draws at the
    second look read it within the tolerance); pooled, +0.10 is rolled back about three times in four, +0.074 is
    promoted less often, and a change within the tolerance still passes every time. At the tolerance itself the
    pooled gate fails no more often than its two looks' alpha."""
    def outcomes(increase: float, pooled: bool, trials: int = 400) -> dict[str, int]:
        rng = random.Random(17)
        seen = [_rollout_of_looks(increase, 2, pooled, rng) for _ in range(trials)]
        return {k: seen.count(k) for k in ("pass", "fail", "paused")}

    fresh, pooled = outcomes(0.10, False), outcomes(0.10, True)
    assert fresh["fail"] < 0.6 * 400 and pooled["fail"] > 0.7 * 400, (fresh, pooled)
    mild_fresh, mild_pooled = outcomes(0.074, False), outcomes(0.074, True)
    assert mild_pooled["pass"] < 0.75 * mild_fresh["pass"], (mild_fresh, mild_pooled)
    assert mild_pooled["fail"] > 1.5 * mild_fresh["fail"], (mild_fresh, mild_pooled)
    assert outcomes(0.02, True)["pass"] == 400
    assert outcomes(MARGIN, True)["fail"] <= (2 * ALPHA + 0.01) * 400
