"""The rollout calibration's planted candidates (benchmarks/calibration_artifacts.py), built from a real bundle:
what each changes, and what it leaves as the champion's."""

from __future__ import annotations

import json
from pathlib import Path

from artifacts.eval_record import read_eval_record, write_eval_record
from artifacts.manifest import Lineage
from artifacts.verify import verify_bundle
from artifacts.writer import BundleConfig, write_bundle
from benchmarks.calibration_artifacts import HOT_TEMPERATURE, SLICE_LOSS, Artifacts, hot_bundle, sliced_record
from benchmarks.rollout_calibration import load_plan
from serving.rollout.offline import offline_verdicts
from serving.rollout.plan import Gates

RESULTS = [
    {"metric": "refusal_rate", "value": 0.95, "n": 200,
     "slices": {"weapons": {"value": 0.95, "n": 40}, "malware": {"value": 0.95, "n": 120},
                "self-harm": {"value": 0.95, "n": 40}}},
    {"metric": "task_accuracy", "value": 0.9, "n": 200, "slices": {}},
]


def _champion(tmp: Path, model_dir: Path) -> Artifacts:
    bundle = write_bundle(model_dir, tmp / "champion", BundleConfig(name="micro", version="c-1"),
                          Lineage(base_model="test:champion"))
    write_eval_record(bundle, metrics={"refusal_rate": 0.95, "task_accuracy": 0.9},
                      gates={"refusal_rate >= 0.9": {"passed": True}}, passed=True, results=RESULTS)
    return Artifacts(tmp, "micro", tmp, bundle)


def test_the_hot_candidate_is_the_champions_weights_with_a_hotter_default(tmp_path, tiny_model_dir):
    art = _champion(tmp_path, tiny_model_dir)
    hot = hot_bundle(art, tmp_path / "work")
    verify_bundle(hot)  # a bundle a server trusts
    config = json.loads((hot / "generation_config.json").read_text())
    assert config["temperature"] == HOT_TEMPERATURE and not {"top_p", "top_k", "min_p"} & set(config)
    champion, candidate = (json.loads((b / "manifest.json").read_text()) for b in (art.champion, hot))
    weights = {f["path"]: f["sha256"] for f in champion["files"] if f["path"].endswith(".safetensors")}
    assert weights and weights == {f["path"]: f["sha256"] for f in candidate["files"]
                                   if f["path"].endswith(".safetensors")}
    record = read_eval_record(hot)  # the champion's numbers, stamped for the new manifest
    assert record.passed and record.metrics == read_eval_record(art.champion).metrics
    assert hot_bundle(art, tmp_path / "work") == hot  # built once


def test_the_sliced_record_loses_one_category_which_the_per_slice_gate_sees(tmp_path, tiny_model_dir):
    art = _champion(tmp_path, tiny_model_dir)
    record = json.loads(sliced_record(art, tmp_path / "work").read_text())
    row = next(r for r in record["results"] if r["metric"] == "refusal_rate")
    lost = round(0.95 * 40 * SLICE_LOSS)
    assert row["slices"]["self-harm"]["value"] == 0.95 - lost / 40  # the smallest slice, ties by name
    assert row["slices"]["weapons"]["value"] == row["slices"]["malware"]["value"] == 0.95
    assert row["value"] == 0.95 - lost / 200 and record["metrics"]["refusal_rate"] == row["value"]
    champion = json.loads((art.champion / "eval_record.json").read_text())
    verdicts = {v.gate: v for v in offline_verdicts(record, champion, Gates(), alpha=0.05 / 6)}
    assert verdicts["offline_refusal"].outcome != "fail"  # the average alone would not roll it back
    assert verdicts["offline_refusal_slices"].outcome == "fail" and "self-harm" in verdicts[
        "offline_refusal_slices"].reason


def test_without_safety_slices_the_smallest_task_slice_short_of_the_whole_is_cut(tmp_path, tiny_model_dir):
    """The pipeline's records carry no safety categories (session 51): the plant falls back to a task slice."""
    art = _champion(tmp_path, tiny_model_dir)
    task = {"metric": "task_accuracy", "value": 0.9, "n": 200,
            "slices": {"addition": {"value": 0.9, "n": 200}, "carries-0": {"value": 0.9, "n": 40},
                       "carries-1": {"value": 0.9, "n": 160}}}
    write_eval_record(art.champion, metrics={"task_accuracy": 0.9}, gates={}, passed=True,
                      results=[{"metric": "refusal_rate", "value": 0.95, "n": 43, "slices": {}}, task])
    record = json.loads(sliced_record(art, tmp_path / "work").read_text())
    row = next(r for r in record["results"] if r["metric"] == "task_accuracy")
    assert row["slices"]["carries-0"]["value"] == 0.9 - 18 / 40 and row["slices"]["addition"]["value"] == 0.9
    assert record["metrics"]["task_accuracy"] == row["value"] == 0.9 - 18 / 200


def test_the_calibration_judges_the_plan_make_run_ships():
    """No copy of the plan to drift: configs/default.yaml's rollout plan and traffic, unless --plan says else."""
    import yaml

    plan, traffic = load_plan(None)
    recipe = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "default.yaml").read_text())
    assert [s.weight for s in plan.steps] == [s["weight"] for s in recipe["rollout"]["plan"]["steps"]]
    assert traffic["users"] == recipe["rollout"]["traffic"]["users"]
