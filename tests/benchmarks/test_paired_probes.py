"""benchmarks/paired_probes.py on a rollout directory as a calibration leaves it."""

from __future__ import annotations

import json

from benchmarks.paired_probes import main
from serving.rollout.plan import RolloutPlan
from serving.rollout.probes import ProbeScore
from serving.rollout.state import RolloutSpec, RolloutState


def _score(draws: list[int]) -> dict:
    return ProbeScore(sampled=len(draws), sampled_correct=sum(draws), sampled_draws=draws,
                      samples_per_prompt=4).to_json()


def test_each_rollout_is_judged_draw_by_draw_and_as_two_rates(tmp_path, capsys) -> None:
    champion = [1, 0, 1, 1] * 40
    candidate = [0 if i % 8 == 0 else x for i, x in enumerate(champion)]  # 20 prompts lose one right draw
    spec = RolloutSpec(model_name="m", candidate_version="2", champion_version="1", candidate_replicas=[],
                       champion_replicas=[], plan=RolloutPlan())
    for name, probes in (("mild-01", {"candidate": _score(candidate), "champion": _score(champion)}),
                         ("old-01", {"candidate": {"sampled": 160}, "champion": {"sampled": 160}})):
        state = RolloutState(name, spec, phase="rolled_back", probes=probes)
        (tmp_path / "work" / "rollouts" / name).mkdir(parents=True)
        (tmp_path / "work" / "rollouts" / name / "state.json").write_text(json.dumps(state.to_json()))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| mild-01"))
    assert "0.375 vs 0.250" in row and "| 20 / 0 |" in row and "fail (" in row and "inconclusive (" in row
    assert "1 rollout(s) without kept draws" in out


def test_a_directory_without_rollouts_is_one_line(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no rollouts here" in capsys.readouterr().err
