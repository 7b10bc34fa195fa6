"""A rate gate for coupled draws: the sampled probes, where champion and candidate answer each draw with the same seed.

With common random numbers an unchanged model draws the very same answers, and a changed one differs only on some
draws. The two sides are then not independent samples, and the unpaired test of ``judge.rate_gate`` misjudges
them twice over:

- it charges the noise of two independent draws (±0.055 on 160 a side) that the shared seeds removed, so a real
  loss of a few points reads "worse, not significantly" and the shadow phase extends and pauses where it could fail;
- it counts 160 draws as 160 independent samples when they are 4 draws of 40 prompts: a loss confined to a few
  prompts is evidence about those prompts, not about the prompt population, and the unpaired test overstates it.

This test takes each draw's difference (candidate wrong minus champion wrong: -1, 0 or +1), sums it per prompt, and
judges the mean difference against the tolerance with a cluster-robust standard error over prompts (a ratio
estimator, Student's t with prompts − 1 degrees of freedom). Draws either side left unanswered are left out of the
pairs; the verdict says how many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.stats import norm
from scipy.stats import t as student_t

from serving.rollout.judge import DETECT_POWER, FAIL, INCONCLUSIVE, PASS, RATE_EPSILON, Verdict

UNANSWERED = -1  # a draw's outcome when its probe got no answer: 1 right, 0 wrong


@dataclass(frozen=True)
class PairedDraws:
    """Draws answered by both sides, per prompt: how many, and the candidate's extra wrong answers among them."""

    pairs: tuple[int, ...]  # per prompt with at least one pair
    extra_wrong: tuple[int, ...]  # per prompt: candidate wrong and champion right, minus the reverse
    candidate_wrong: int
    baseline_wrong: int
    candidate_only: int  # discordant draws: the candidate alone wrong
    baseline_only: int  # the champion (or baseline) alone wrong
    looks: int = 1  # the looks whose draws are pooled here

    @property
    def n(self) -> int:
        return sum(self.pairs)

    @property
    def prompts(self) -> int:
        return len(self.pairs)


def pair_draws(candidate: list[int], baseline: list[int], per_prompt: int, prompts: int = 0) -> PairedDraws | None:
    """The draws both sides answered, grouped by prompt: draw ``i`` belongs to prompt ``i // per_prompt``, modulo
    ``prompts`` when the lists pool several looks' draws of the same ``prompts`` (0: one look, no wrapping). None
    when the two lists cannot be paired (other lengths or no grouping: a state written before draws were kept)."""
    if per_prompt < 1 or not candidate or len(candidate) != len(baseline):
        return None
    per_look = per_prompt * prompts
    if prompts and len(candidate) % per_look:
        return None
    pairs: dict[int, int] = {}
    extra: dict[int, int] = {}
    c_wrong = b_wrong = c_only = b_only = 0
    for draw, (c, b) in enumerate(zip(candidate, baseline, strict=True)):
        if c == UNANSWERED or b == UNANSWERED:
            continue
        prompt = (draw // per_prompt) % prompts if prompts else draw // per_prompt
        pairs[prompt] = pairs.get(prompt, 0) + 1
        c_wrong += 1 - c
        b_wrong += 1 - b
        c_only += c < b
        b_only += b < c
        extra[prompt] = extra.get(prompt, 0) + (b - c)
    order = sorted(pairs)
    return PairedDraws(tuple(pairs[p] for p in order), tuple(extra[p] for p in order), c_wrong, b_wrong, c_only,
                       b_only, len(candidate) // per_look if prompts else 1)


def paired_rate_gate(gate: str, draws: PairedDraws, *, margin: float, alpha: float, min_samples: int,
                     label: str, critical: bool = True) -> Verdict:
    """Fail when the candidate's rate of wrong draws exceeds the champion's on the same draws by more than
    ``margin`` (one-sided, level ``alpha``); pass when the estimate is within it; else inconclusive.

    ``detectable``: the smallest true increase this look would fail with ``DETECT_POWER``, at the look's own spread
    or the least an increase of that size brings (every extra wrong answer is a discordant draw), whichever is
    larger: a look whose draws all agree has no spread at all, yet 160 draws could not fail an increase just over
    the tolerance."""
    n, prompts = draws.n, draws.prompts
    rule = f"≤ baseline + {margin:g} (paired draws)"
    p_c = draws.candidate_wrong / n if n else None
    p_b = draws.baseline_wrong / n if n else None
    if n < min_samples or prompts < 2:
        return Verdict(gate, INCONCLUSIVE, p_c, p_b, rule, None, n, min_samples,
                       f"too few paired draws ({n} from {prompts} prompts; need {min_samples} from 2 or more)",
                       critical)
    diff = (draws.candidate_wrong - draws.baseline_wrong) / n
    se = _cluster_se(draws, diff)
    df = prompts - 1
    if se > 0:
        p_value = float(student_t.sf((diff - margin) / se, df))
    else:  # every prompt moved by the same share of its draws (in practice: none moved)
        p_value = 0.0 if diff > margin + RATE_EPSILON else 1.0
    detectable = _detectable(se, n, df, margin=margin, alpha=alpha)
    looks = f" over {draws.looks} looks" if draws.looks > 1 else ""
    seen = (f"{n} draws of {prompts} prompts{looks}, {draws.candidate_only} wrong on the candidate alone and "
            f"{draws.baseline_only} on the champion alone")
    could = f"this look would fail +{detectable:.3f} with {DETECT_POWER:.0%} power"
    if p_value < alpha:
        return Verdict(gate, FAIL, p_c, p_b, rule, p_value, n, min_samples,
                       f"{label} {p_c:.3f} vs {p_b:.3f} on the same draws: worse by {diff:+.3f}, beyond {margin:g} "
                       f"(p={p_value:.2g}; {seen})", critical, detectable)
    if diff > margin + RATE_EPSILON:
        return Verdict(gate, INCONCLUSIVE, p_c, p_b, rule, p_value, n, min_samples,
                       f"{label} {p_c:.3f} vs {p_b:.3f} on the same draws: worse by {diff:+.3f} but not "
                       f"significantly (p={p_value:.2g}; {seen}; {could})", critical, detectable)
    return Verdict(gate, PASS, p_c, p_b, rule, p_value, n, min_samples,
                   f"{label} {p_c:.3f} vs {p_b:.3f} on the same draws (within {margin:g}; {seen}; {could})",
                   critical, detectable)


def _cluster_se(draws: PairedDraws, diff: float) -> float:
    """The standard error of the mean paired difference with prompts as clusters (the linearised ratio estimator:
    each prompt's residual is its extra wrong answers minus what the mean difference predicts for its draws)."""
    prompts = draws.prompts
    spread = sum((extra - diff * pairs) ** 2 for extra, pairs in zip(draws.extra_wrong, draws.pairs, strict=True))
    return math.sqrt(prompts / (prompts - 1) * spread) / draws.n


def _detectable(se: float, n: int, df: int, *, margin: float, alpha: float) -> float:
    """The increase ``delta`` that clears ``margin`` by t(1-alpha) + z(power) standard errors, the standard error
    at least that of ``delta`` discordant draws in ``n`` (a few fixed-point steps)."""
    k = float(student_t.ppf(1 - alpha, df) + norm.ppf(DETECT_POWER))
    delta = margin
    for _ in range(12):
        least = math.sqrt(min(delta, 1.0) * max(1.0 - delta, 0.0) / n)
        delta = margin + k * max(se, least)
    return min(delta, 1.0)
