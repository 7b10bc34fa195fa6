"""Is the candidate worse than the champion? One verdict per gate: pass, fail or inconclusive.

Every gate asks the same question with a tolerance: "is the candidate worse than the baseline by more
than the margin?", and answers it in three ways, like Kayenta's canary judge:

- **inconclusive** when there are fewer samples than the gate's minimum (no data is never a pass), or
  when the estimate is worse than the margin but not significantly so (collect more, or ask a person);
- **fail** when a one-sided test rejects "not worse than baseline + margin" at level ``alpha``;
- **pass** otherwise: enough samples, and the estimate within the margin.

Tests, chosen for small counts and for what each gate measures:

- rates (5xx, 429, wrong answers, refusals missed, broken format, shadow disagreement): the Agresti-Caffo
  adjusted Wald test for a difference of proportions (add one success and one failure to each side),
  which keeps its error rate near nominal even at 0 errors in 100 requests, where the plain Wald test
  has no variance at all;
- canary latency (TTFT, inter-token), candidate against a baseline replica of equal standing: a
  Mann-Whitney U test of a shift on the log scale with a tolerance band, and the Hodges-Lehmann estimate of
  the ratio with its one-sided confidence bound (Kayenta's judge). Both samples are random, so neither
  side's quantile may be treated as a fixed number; the rank test uses every sample, which gives it the
  power to see a +50% TTFT shift in a few dozen requests a side, where a test of p95 exceedances needs
  hundreds; and it ignores the outliers shared cores produce. The price is that a regression confined to
  the slowest few percent moves the median little; the shadow phase's pairwise test below covers tails.
- shadow latency (ms per output token), each mirrored request against the champion's answer to the very
  same request: the ratio of the two sides' p95 over the same pairs, bounded by a paired bootstrap (whole
  pairs resampled). Both answers of a pair ran at the same moment on the same host, so a burst of load lands
  on both; against the champion pool's requests instead (the old gate), the A/A ratio wandered ×1.0-1.5 with
  whatever else the host ran.

The 5xx and 429 gates, and the canary's TTFT and ITL gates, also carry the regression they exist to catch
(``effect``: +3 points of 5xx, ×1.25 TTFT): a look passes them only when it could have failed that regression with
the design power, else it is inconclusive and says how many more requests would do (evidence.py decides whether
the rollout moves on or waits for them). Tolerance and design effect are two numbers on purpose: a regression
equal to the tolerance cannot be failed more often than alpha by any test of that tolerance.

Looking at the data after every step would inflate false alarms, so the controller divides ``alpha``
over the most analyses a rollout makes on its own, planned ones and extensions (Bonferroni): each gate fails a
good candidate with probability at most ``alpha`` over the whole rollout, however many steps it has. (Not the
rollout as a whole: a dozen gates each get that budget; the tolerance bands keep the real rate far below it,
which benchmarks/rollout_calibration.py measures.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import mannwhitneyu, norm

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class Verdict:
    gate: str
    outcome: str  # pass | fail | inconclusive
    candidate: float | None  # the candidate's measured value
    baseline: float | None  # the champion's (or the noise floor's)
    threshold: str  # the rule, readable: "≤ baseline + 0.01", "≤ 1.5× baseline"
    p_value: float | None
    samples: int
    min_samples: int
    reason: str
    critical: bool = True
    # rate gates: the smallest true increase over the baseline this look would have failed, with DETECT_POWER;
    # latency gates: the smallest true ratio
    detectable: float | None = None
    # rate and latency gates with a design effect: how many more candidate requests (both sides growing as they
    # do) would let a look fail that effect with the design power; 0 when this look already could
    more_samples: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def short(self) -> str:
        value = "–" if self.candidate is None else f"{self.candidate:.3g}"
        return f"{self.gate} {value} ({self.outcome})"


DETECT_POWER = 0.8
# two rates exactly at the tolerance apart (8/40 vs 6/40: +0.05) must read as within it, not 0.05000000000000002
RATE_EPSILON = 1e-9


def rate_gate(gate: str, bad_candidate: int, n_candidate: int, bad_baseline: int, n_baseline: int, *,
              margin: float, alpha: float, min_samples: int, critical: bool = True,
              label: str = "rate", effect: float | None = None, power: float | None = None) -> Verdict:
    """Fail when the candidate's rate of bad outcomes exceeds the baseline's by more than ``margin``.

    ``effect``: the increase this gate exists to catch (5xx +0.03 against a tolerance of 0.01). With it, a look
    passes only when it could have failed that effect with probability ``power``: an estimate within the
    tolerance on too few requests is inconclusive, saying how many more requests would settle it
    (``Verdict.more_samples``), never a pass that no regression of that size could have turned into a fail.
    """
    power = DETECT_POWER if power is None else power
    rule = f"≤ baseline + {margin:g}"
    n = min(n_candidate, n_baseline)
    p_c = bad_candidate / n_candidate if n_candidate else None
    p_b = bad_baseline / n_baseline if n_baseline else None
    if n < min_samples:
        return Verdict(gate, INCONCLUSIVE, p_c, p_b, rule, None, n, min_samples,
                       f"too few samples ({n_candidate} candidate, {n_baseline} baseline; need {min_samples})",
                       critical)
    pc = (bad_candidate + 1) / (n_candidate + 2)
    pb = (bad_baseline + 1) / (n_baseline + 2)
    se = math.sqrt(pc * (1 - pc) / (n_candidate + 2) + pb * (1 - pb) / (n_baseline + 2))
    z = (pc - pb - margin) / se
    p_value = float(norm.sf(z))
    diff = p_c - p_b
    detectable = detectable_increase(pb, n_candidate, n_baseline, margin=margin, alpha=alpha, power=power)
    could = f"this look would fail +{detectable:.3f} with {power:.0%} power"
    if p_value < alpha:
        return Verdict(gate, FAIL, p_c, p_b, rule, p_value, n, min_samples,
                       f"{label} {p_c:.3f} vs {p_b:.3f}: worse by {diff:+.3f}, beyond {margin:g} (p={p_value:.2g})",
                       critical, detectable)
    more = None
    if effect is not None:  # the look's own detectable increase settles the common case without a search
        more = 0 if detectable <= effect else samples_for_power(pb, n_candidate, n_baseline, margin=margin,
                                                                alpha=alpha, effect=effect, power=power)
    if diff > margin + RATE_EPSILON:
        settle = f"; ~{more} more candidate requests would settle +{effect:g}" if more else ""
        return Verdict(gate, INCONCLUSIVE, p_c, p_b, rule, p_value, n, min_samples,
                       f"{label} {p_c:.3f} vs {p_b:.3f}: worse by {diff:+.3f} but not significantly "
                       f"(p={p_value:.2g}; {could}{settle})", critical, detectable, more)
    if more:
        return Verdict(gate, INCONCLUSIVE, p_c, p_b, rule, p_value, n, min_samples,
                       f"{label} {p_c:.3f} vs {p_b:.3f}, within {margin:g}, but {could}, not the +{effect:g} "
                       f"this gate must catch: ~{more} more candidate requests", critical, detectable, more)
    return Verdict(gate, PASS, p_c, p_b, rule, p_value, n, min_samples,
                   f"{label} {p_c:.3f} vs {p_b:.3f} (within {margin:g}; {could})", critical, detectable, more)




def detectable_increase(p_baseline: float, n_candidate: int, n_baseline: int, *, margin: float, alpha: float,
                        power: float = DETECT_POWER) -> float:
    """The smallest true increase over ``p_baseline`` that ``rate_gate`` fails with probability ``power`` at these
    sample sizes: what a pass at this look rules out. The test fails when the estimate clears ``margin`` by
    z(1-alpha) standard errors, so the increase must clear it by z(1-alpha) + z(power) of them; the standard error
    is taken at the increased rate (Agresti-Caffo counts, as the test), solved by a few fixed-point steps."""
    k = float(norm.ppf(1 - alpha) + norm.ppf(power))
    delta = margin
    for _ in range(8):
        p_c = min(p_baseline + delta, 1.0)
        se = math.sqrt(p_c * (1 - p_c) / (n_candidate + 2) + p_baseline * (1 - p_baseline) / (n_baseline + 2))
        delta = margin + k * se
    return min(delta, 1.0 - p_baseline)


def samples_for_power(p_baseline: float, n_candidate: int, n_baseline: int, *, margin: float, alpha: float,
                      effect: float, power: float = DETECT_POWER) -> int:
    """How many more candidate requests a look needs before it fails a true increase of ``effect`` with
    probability ``power``: both sides grown in their present proportion (a sticky split keeps it), the smallest
    such growth found by bisection on ``detectable_increase``. 0 when this look already could."""
    def enough(scale: float) -> bool:
        return detectable_increase(p_baseline, round(n_candidate * scale), round(n_baseline * scale), margin=margin,
                                   alpha=alpha, power=power) <= effect

    if enough(1.0):
        return 0
    low, high = 1.0, 2.0
    while not enough(high):
        low, high = high, high * 2
        if high > 1e6:
            break
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return max(1, math.ceil(n_candidate * high) - n_candidate)


PAIRED_BOOTSTRAP_ROUNDS = 2000
PAIRED_MAX_SAMPLES = 1000  # pairs resampled per round (a larger window is thinned, the same way every time)


def paired_latency_gate(gate: str, pairs: list[tuple[float, float]] | list[list[float]], *, max_ratio: float,
                        alpha: float, min_samples: int, critical: bool = True, q: float = 0.95) -> Verdict:
    """Fail when the candidate's ``q``-quantile is significantly above ``max_ratio`` × the champion's, both taken
    over the same mirrored requests: ``pairs`` holds (champion, candidate) per request.

    Why quantiles of the two sides and not of per-request ratios: ms per token depends on the answer's
    length (the prompt's prefill is spread over its tokens), and two models give the same prompt answers of
    different lengths, so a single pair's ratio says as much about lengths as about speed (an equally fast
    model read ×2 at the pairs' p95). Over the same requests, each side's p95 meets the same prompts at the
    same moments. The bound comes from a paired bootstrap: whole pairs are resampled, so the correlation the
    shared moment gives both sides narrows the interval instead of being ignored. The one-sided p-value is
    the share of rounds whose ratio stays within the tolerance.
    """
    rule = f"p{round(q * 100)} ≤ {max_ratio:g}× champion, same requests"
    values = np.asarray(pairs, dtype=float).reshape(-1, 2)
    n = len(values)
    if n < min_samples:
        return Verdict(gate, INCONCLUSIVE, None, 1.0, rule, None, n, min_samples,
                       f"too few mirrored pairs with tokens ({n}; need {min_samples})", critical)
    champion, candidate = values[:, 0], values[:, 1]
    ratio = float(np.quantile(candidate, q) / max(float(np.quantile(champion, q)), 1e-9))
    rng = np.random.default_rng(0)
    if n > PAIRED_MAX_SAMPLES:
        values = values[rng.choice(n, PAIRED_MAX_SAMPLES, replace=False)]
    rounds = values[rng.integers(0, len(values), size=(PAIRED_BOOTSTRAP_ROUNDS, len(values)))]
    ratios = np.quantile(rounds[..., 1], q, axis=1) / np.maximum(np.quantile(rounds[..., 0], q, axis=1), 1e-9)
    p_value = float((np.sum(ratios <= max_ratio) + 1) / (PAIRED_BOOTSTRAP_ROUNDS + 1))
    lower = float(np.quantile(ratios, alpha))
    per_pair = float(np.median(candidate / np.maximum(champion, 1e-9)))
    detail = (f"p{round(q * 100)} {np.quantile(candidate, q):.1f} vs {np.quantile(champion, q):.1f} ms/token on "
              f"{n} mirrored requests (×{ratio:.2f}, ≥ ×{lower:.2f} at {1 - alpha:.1%}); median pair ×{per_pair:.2f}")
    return _ratio_verdict(gate, ratio, max_ratio, p_value, alpha, rule, n, min_samples, detail, critical)



def _ratio_verdict(gate: str, ratio: float, max_ratio: float, p_value: float, alpha: float, rule: str, n: int,
                   min_samples: int, detail: str, critical: bool) -> Verdict:
    """A latency ratio's verdict: fail when significantly beyond the band, inconclusive when above it by
    chance alone, else pass."""
    if p_value < alpha:
        return Verdict(gate, FAIL, ratio, 1.0, rule, p_value, n, min_samples,
                       f"{detail}: beyond ×{max_ratio:g} (p={p_value:.2g})", critical)
    if ratio > max_ratio:
        return Verdict(gate, INCONCLUSIVE, ratio, 1.0, rule, p_value, n, min_samples,
                       f"{detail}: above ×{max_ratio:g} but not significantly (p={p_value:.2g})", critical)
    return Verdict(gate, PASS, ratio, 1.0, rule, p_value, n, min_samples, detail, critical)

HL_MAX_SAMPLES = 1500  # per side for the Hodges-Lehmann estimate (all pairs: 2.25M differences at most)


def shift_gate(gate: str, candidate: list[float], baseline: list[float], *, max_ratio: float, alpha: float,
               min_samples: int, critical: bool = True, against: str = "baseline", effect: float | None = None,
               power: float | None = None) -> Verdict:
    """Fail when the candidate's values are significantly more than ``max_ratio`` × the baseline's.

    H0: log(candidate) ≤ log(baseline) + log(max_ratio), tested one-sided with Mann-Whitney U on the
    baseline shifted by the tolerance. The value is the Hodges-Lehmann ratio (the median of all pairwise
    candidate/baseline ratios); a fail means its lower confidence bound lies beyond the band.

    ``effect``: the ratio this gate exists to catch (TTFT ×1.25 against a tolerance of ×1.10), as the rate gates'
    design increase. A look passes only when it could have failed that ratio with probability ``power``; an
    estimate within the tolerance on too few requests is inconclusive and says how many more would do. Without
    a design ratio, a drill *at* the tolerance (×1.25 against ×1.25) passes half the time whatever the samples.
    """
    power = DETECT_POWER if power is None else power
    rule = f"HL ratio ≤ {max_ratio:g}× {against}"
    n = min(len(candidate), len(baseline))
    if n < min_samples:
        return Verdict(gate, INCONCLUSIVE, None, 1.0, rule, None, n, min_samples,
                       f"too few samples ({len(candidate)} candidate, {len(baseline)} {against}; need {min_samples})",
                       critical)
    log_c = np.log(np.maximum(np.asarray(candidate, dtype=float), 1e-6))
    log_b = np.log(np.maximum(np.asarray(baseline, dtype=float), 1e-6))
    tolerance = math.log(max_ratio)
    p_value = float(mannwhitneyu(log_c, log_b + tolerance, alternative="greater").pvalue)
    ratio, lower, upper = hodges_lehmann_ratio(log_c, log_b, alpha)
    # the standard error of the log shift, read off the distribution-free interval: what the design power needs
    se = max(math.log(upper / lower), 0.0) / (2 * float(norm.ppf(1 - alpha)))
    k = float(norm.ppf(1 - alpha) + norm.ppf(power))
    detectable = max_ratio * math.exp(k * se)
    medians = f"median {float(np.median(np.exp(log_c))):.1f} vs {float(np.median(np.exp(log_b))):.1f} ms"
    detail = f"{medians}; HL ×{ratio:.2f} (≥ ×{lower:.2f} at {1 - alpha:.1%}), {len(candidate)}/{len(baseline)} samples"
    could = f"this look would fail ×{detectable:.2f} with {power:.0%} power"
    if p_value < alpha:
        return Verdict(gate, FAIL, ratio, 1.0, rule, p_value, n, min_samples,
                       f"{detail}: beyond ×{max_ratio:g} (p={p_value:.2g})", critical, detectable)
    more = None
    if effect is not None:
        scale = (k * se / math.log(effect / max_ratio)) ** 2  # se shrinks as 1/√n with both sides grown alike
        more = 0 if detectable <= effect else max(1, math.ceil(len(candidate) * scale) - len(candidate))
    if ratio > max_ratio:
        settle = f"; ~{more} more candidate requests would settle ×{effect:g}" if more else ""
        return Verdict(gate, INCONCLUSIVE, ratio, 1.0, rule, p_value, n, min_samples,
                       f"{detail}: above ×{max_ratio:g} but not significantly (p={p_value:.2g}; {could}{settle})",
                       critical, detectable, more)
    if more:
        return Verdict(gate, INCONCLUSIVE, ratio, 1.0, rule, p_value, n, min_samples,
                       f"{detail}: within ×{max_ratio:g}, but {could}, not the ×{effect:g} this gate must catch: "
                       f"~{more} more candidate requests", critical, detectable, more)
    return Verdict(gate, PASS, ratio, 1.0, rule, p_value, n, min_samples, f"{detail} ({could})", critical,
                   detectable, more)


def hodges_lehmann_ratio(log_c: np.ndarray, log_b: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """exp of the Hodges-Lehmann shift of two log samples, and its one-sided (1 - alpha) lower and upper bounds,
    from the order statistics of the pairwise differences (the distribution-free bounds that invert the U test)."""
    rng = np.random.default_rng(0)  # large samples are thinned the same way every time
    if len(log_c) > HL_MAX_SAMPLES:
        log_c = rng.choice(log_c, HL_MAX_SAMPLES, replace=False)
    if len(log_b) > HL_MAX_SAMPLES:
        log_b = rng.choice(log_b, HL_MAX_SAMPLES, replace=False)
    diffs = np.sort((log_c[:, None] - log_b[None, :]).ravel())
    n1, n2 = len(log_c), len(log_b)
    k = int(math.floor(n1 * n2 / 2 - norm.ppf(1 - alpha) * math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)))
    k = min(max(k, 0), len(diffs) - 1)
    lower, upper = diffs[k], diffs[len(diffs) - 1 - k]
    return float(math.exp(np.median(diffs))), float(math.exp(lower)), float(math.exp(upper))


def check_gate(gate: str, passed: bool | None, reason: str, critical: bool = True) -> Verdict:
    """A yes/no fact (the offline eval record, replica availability); None means unknown → inconclusive."""
    outcome = INCONCLUSIVE if passed is None else (PASS if passed else FAIL)
    value = None if passed is None else float(passed)
    return Verdict(gate, outcome, value, 1.0, "passed", None, int(passed is not None), 1, reason, critical)


def per_look_alpha(alpha: float, planned_looks: int) -> float:
    """Bonferroni: each of ``planned_looks`` analyses tests at ``alpha / planned_looks``."""
    return alpha / max(1, planned_looks)
