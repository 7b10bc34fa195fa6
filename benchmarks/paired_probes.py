"""The sampled probes judged both ways: draw by draw (the gate) and as two independent rates (the gate before).

Reads the rollouts a calibration ran (``benchmarks/rollout_calibration.py --out DIR``) and, for each, the last look's
sampled probes (the state keeps the latest probes; since the looks pool their sampled draws, those of every look
judged so far), and judges them twice at the rollout's own level per look:

    .venv/bin/python benchmarks/paired_probes.py DIR [DIR ...]

A state written before the draws were kept has no pairs and is left out, said so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from serving.rollout import judge  # noqa: E402
from serving.rollout.analysis import planned_alpha  # noqa: E402
from serving.rollout.paired_rates import pair_draws, paired_rate_gate  # noqa: E402
from serving.rollout.state import RolloutState  # noqa: E402

GATE = "probe_sampled_accuracy"


def judged_both_ways(state: RolloutState) -> tuple[judge.Verdict, judge.Verdict] | None:
    """(paired, unpaired) verdicts on the state's last sampled probes; None without kept draws."""
    probes = state.probes or {}
    c, b = probes.get("candidate"), probes.get("champion")
    if not c or not b or not c.get("sampled_draws"):
        return None
    draws = pair_draws(c["sampled_draws"], b["sampled_draws"], c.get("samples_per_prompt", 0),
                       c.get("sampled_prompts", 0))
    if draws is None:
        return None
    plan = state.spec.plan
    alpha, margin = planned_alpha(plan), plan.gates.max_accuracy_drop
    need = max(5, min(c["sampled"] + c.get("sampled_errors", 0), 10))
    paired = paired_rate_gate(GATE, draws, margin=margin, alpha=alpha, min_samples=need, label="wrong")
    unpaired = judge.rate_gate(GATE, c["sampled"] - c["sampled_correct"], c["sampled"],
                               b["sampled"] - b["sampled_correct"], b["sampled"], margin=margin, alpha=alpha,
                               min_samples=need, label="wrong")
    return paired, unpaired


def table(outs: list[Path]) -> list[str]:
    lines = ["| rollout | outcome | wrong: candidate vs champion (same draws) | discordant: candidate alone / champion "
             "alone | paired (p) | unpaired (p) |", "|---|---|---|---|---|---|"]
    skipped = 0
    for out in outs:
        for path in sorted((out / "work" / "rollouts").glob("*/state.json")):
            state = RolloutState.from_json(json.loads(path.read_text()))
            both = judged_both_ways(state)
            if both is None:
                skipped += 1
                continue
            paired, unpaired = both
            probes = state.probes["candidate"]["sampled_draws"], state.probes["champion"]["sampled_draws"]
            alone = sum(c == 0 and b == 1 for c, b in zip(*probes)), sum(c == 1 and b == 0 for c, b in zip(*probes))
            lines.append(f"| {state.id} | {state.phase} | {paired.candidate:.3f} vs {paired.baseline:.3f} | "
                         f"{alone[0]} / {alone[1]} | {paired.outcome} ({paired.p_value:.2g}) | "
                         f"{unpaired.outcome} ({unpaired.p_value:.2g}) |")
    if skipped:
        lines.append(f"\n{skipped} rollout(s) without kept draws (written before the paired gate, or not probed "
                     "yet) left out")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outs", type=Path, nargs="+", help="calibration output directories (--out)")
    args = ap.parse_args(argv)
    missing = [str(o) for o in args.outs if not (o / "work" / "rollouts").is_dir()]
    if missing:
        print(f"error: {', '.join(missing)}: no rollouts here (a rollout_calibration.py --out directory)",
              file=sys.stderr)
        return 2
    print("\n".join(table(args.outs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
