"""What the rollout calibration takes from the pipeline's workdir (read only), and its own MLflow registry.

``benchmarks/rollout_calibration.py`` registers the pipeline's champion bundle (and each scenario's candidate) in
a store of its own, so the pipeline's registry is only ever read.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from benchmarks.calibration_outcomes import TRAINED_ADAPTER_SCENARIOS


class CalibrationError(Exception):
    """Something the user can fix (a missing artifact, a bad flag): one line, exit 2."""


@dataclass
class Artifacts:
    """What the calibration takes from the pipeline's workdir (read only)."""

    workdir: Path
    model_name: str
    data_dir: Path
    champion: Path  # a bundle dir with its eval record beside the manifest
    drill: Path | None = None
    base_model: Path | None = None
    base_results: Path | None = None  # eval_results.json of the pipeline's eval of the base model
    sft_adapter: Path | None = None  # the pipeline's SFT adapter, trained on base_model (the trained adapter scenarios)


def _complete(stage_dir: Path) -> bool:
    return (stage_dir / "STAGE_DONE.json").is_file()


def _pipeline_client(workdir: Path):
    from mlflow import MlflowClient

    db = workdir / "mlflow.db"
    if not db.is_file():
        raise CalibrationError(f"{db}: no pipeline registry (run `make run` first)")
    return MlflowClient(tracking_uri=f"sqlite:///{db}")


def _alias_digest(workdir: Path, alias: str) -> tuple[str, str] | None:
    """(registered model, manifest digest) of the pipeline registry's version with ``alias``."""
    from mlflow.exceptions import MlflowException

    client = _pipeline_client(workdir)
    for model in client.search_registered_models():
        try:
            mv = client.get_model_version_by_alias(model.name, alias)
        except MlflowException:
            continue
        return model.name, (mv.tags or {}).get("manifest_digest", "")
    return None


def _bundle_by_digest(workdir: Path, digest: str) -> Path | None:
    from artifacts.manifest import manifest_digest

    for manifest in sorted(workdir.glob("runs/*/bundle-*/bundle/manifest.json")):
        if manifest_digest(manifest.parent) == digest:
            return manifest.parent
    return None


def find_artifacts(workdir: Path, champion: str, need: set[str]) -> Artifacts:
    """The data dir, the champion's bundle and, for the scenarios in ``need``, the drill bundle and the base model."""
    runs = workdir / "runs"
    data = sorted((d for d in runs.glob("*/data-*") if _complete(d)), key=lambda d: d.stat().st_mtime)
    if not data:
        raise CalibrationError(f"{runs}: no finished data stage (data-*/STAGE_DONE.json)")
    if Path(champion).is_dir():
        bundle, model_name = Path(champion).resolve(), ""
    else:
        found = _alias_digest(workdir, champion)
        if found is None:
            raise CalibrationError(f"{workdir / 'mlflow.db'}: no version has the alias {champion!r} "
                                   "(give --champion a bundle directory instead)")
        model_name, digest = found
        bundle = _bundle_by_digest(workdir, digest)
        if bundle is None:
            raise CalibrationError(f"alias {champion!r}: no bundle under {runs} has manifest digest {digest[:12]}")
    if not (bundle / "eval_record.json").is_file():
        raise CalibrationError(f"{bundle}: no eval_record.json beside the manifest (not released by the pipeline)")
    if not model_name:
        model_name = json.loads((bundle / "manifest.json").read_text())["name"]
    out = Artifacts(workdir, model_name, data[-1] / "data", bundle)
    if "refusals" in need:
        found = _alias_digest(workdir, "drill-candidate")
        if found is None:
            raise CalibrationError("no version has the alias `drill-candidate` in the pipeline registry (run "
                                   "`lifecycle run configs/drill-broken-refusals.yaml`, or leave out --scenarios "
                                   "refusals)")
        out.drill = _bundle_by_digest(workdir, found[1])
        if out.drill is None:
            raise CalibrationError(f"drill-candidate: no bundle under {runs} has digest {found[1][:12]}")
    if need & {"accuracy", *TRAINED_ADAPTER_SCENARIOS}:
        for stage in sorted(runs.glob("*/eval-base-*")):
            if _complete(stage) and (stage / "eval_results.json").is_file():
                info = json.loads((stage / "STAGE_DONE.json").read_text()).get("info", {})
                if info.get("model") and (Path(info["model"]) / "config.json").is_file():
                    out.base_model, out.base_results = Path(info["model"]), stage / "eval_results.json"
        if out.base_model is None:
            models = sorted((workdir / "models" / "base").glob("*/config.json"))
            if not models:
                raise CalibrationError(f"{workdir / 'models' / 'base'}: no base model")
            out.base_model = models[-1].parent
    if need & set(TRAINED_ADAPTER_SCENARIOS):
        out.sft_adapter = _trained_on(runs, "sft", out.base_model)
        source = json.loads((bundle / "manifest.json").read_text()).get("lineage", {}).get("source_dir", "")
        if Path(source).resolve() != out.base_model.resolve():
            raise CalibrationError(f"{bundle}: the trained adapter scenarios need the base model's bundle as "
                                   f"--champion (the adapter release form's runs/*/bundle-base-*/bundle); this one "
                                   f"is of {source or 'an unknown model'}, not {out.base_model}")
    return out


def _trained_on(runs: Path, stage: str, base_model: Path) -> Path:
    """The adapter of the newest finished ``stage`` of the recipe whose base stage built ``base_model`` (SFT is
    the first stage: its adapter is one of that base)."""
    for base_done in sorted(runs.glob("*/base-*/STAGE_DONE.json")):
        if Path(json.loads(base_done.read_text()).get("path", "")).resolve() != base_model.resolve():
            continue
        recipe_runs = base_done.parent.parent
        done = sorted(recipe_runs.glob(f"{stage}-*/STAGE_DONE.json"), key=lambda f: f.stat().st_mtime)
        for record in reversed(done):
            adapter = Path(json.loads(record.read_text()).get("info", {}).get("adapter_dir", ""))
            if (adapter / "adapter_config.json").is_file():
                return adapter
    raise CalibrationError(f"{runs}: no finished {stage} stage with an adapter, of the recipe whose base is "
                           f"{base_model}")


# ----------------------------------------------------------------------------- the calibration's registry
class Registry:
    """An MLflow store of the calibration's own: v1 the champion, one version per candidate."""

    def __init__(self, root: Path, model_name: str) -> None:
        from mlflow import MlflowClient

        self.root = root
        self.tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
        self.model_name = model_name
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.versions: dict[str, str] = {}  # label -> version

    def register(self, label: str, bundle: Path, record: Path | None, aliases: tuple[str, ...] = ()) -> str:
        """Register ``bundle`` (once per label) and, as the pipeline's release stage does, tag the verdict
        of its eval record and log the record beside the version's run (where the controller reads it)."""
        from artifacts.eval_record import read_eval_record
        from artifacts.registry import register_bundle

        if label in self.versions:
            return self.versions[label]
        ref = register_bundle(bundle, self.model_name, tracking_uri=self.tracking_uri, aliases=aliases,
                              description=f"rollout calibration: {label}")
        if record is not None:
            passed = read_eval_record(bundle).passed  # the record beside the manifest, checked against it
            self.client.log_artifact(ref.run_id, str(record))
            self.client.set_model_version_tag(self.model_name, ref.version, "lifecycle.gates_passed",
                                              str(bool(passed)).lower())
        self.versions[label] = ref.version
        return ref.version

    def reset_aliases(self, champion: str) -> None:
        from mlflow.exceptions import MlflowException

        self.client.set_registered_model_alias(self.model_name, "champion", champion)
        for alias in ("canary", "shadow", "previous-champion"):
            try:
                self.client.delete_registered_model_alias(self.model_name, alias)
            except MlflowException:
                pass


def base_bundle(art: Artifacts, work: Path, champion_manifest: dict) -> tuple[Path, Path | None]:
    """The base model as a bundle, with an eval record made from the pipeline's evaluation of it (the release
    gates are the champion's, re-checked on the base model's results)."""
    from artifacts.eval_record import read_eval_record, write_eval_record
    from artifacts.manifest import Lineage
    from artifacts.writer import BundleConfig, write_bundle
    from evals.gates import check_gates, parse_gate
    from evals.results import read_results_json, to_jsonable

    out = work / "bundles" / "base"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        write_bundle(art.base_model, out, BundleConfig(name=champion_manifest["name"],
                                                       version=f"base-{art.base_model.name[:12]}"),
                     Lineage(base_model=str(art.base_model)))
    if art.base_results is None:
        return out, None
    results = read_results_json(art.base_results)
    gates = [parse_gate(g) for g in (read_eval_record(art.champion).gates or {})]
    report = check_gates(results, gates)
    metrics = {f"{r.metric}": r.value for r in results}
    gate_record = {str(c.gate): {"measured": c.measured, "passed": c.passed, "reason": c.reason}
                   for c in report.checks}
    return out, write_eval_record(out, metrics=metrics, gates=gate_record, passed=report.passed,
                                  results=to_jsonable(results))


HOT_TEMPERATURE = 2.0  # the "sampled" scenario's default temperature (the champion's bundles ship 1.0 or none)
# the "sampled-mild" scenario's: a loss of a few points of sampled accuracy, a few times the gate's 0.05 tolerance
# (RESULTS.md, "Sampled probes, draw by draw"), where two independent rates of 160 draws cannot tell it from noise
MILD_TEMPERATURE = 1.3
SLICE_LOSS = 0.5  # the "slice" scenario: the share of one harm category's refusals its planted record loses


def hot_bundle(art: Artifacts, work: Path, temperature: float = HOT_TEMPERATURE, name: str = "hot") -> Path:
    """The champion's weights bundled again with a hotter default ``temperature`` (top-p, top-k and min-p left
    out), and the champion's eval record: greedy answers unchanged, sampled ones worse, and nothing offline to see
    it. The sampled probes, at the server's own defaults, are what should catch it."""
    from artifacts.eval_record import read_eval_record, write_eval_record
    from artifacts.manifest import Lineage
    from artifacts.writer import BundleConfig, write_bundle

    out = work / "bundles" / name
    if (out / "manifest.json").is_file():
        return out
    source = work / "bundles" / f"{name}-source"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(art.champion, source, ignore=shutil.ignore_patterns("manifest.json", "eval_record.json"))
    config_path = source / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for key in ("top_p", "top_k", "min_p"):
        config.pop(key, None)
    config.update(temperature=temperature, do_sample=True)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    manifest = json.loads((art.champion / "manifest.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    write_bundle(source, out, BundleConfig(name=manifest["name"], version=f"{name}-{manifest['version']}"),
                 Lineage(base_model=str(art.champion)))
    record = read_eval_record(art.champion)
    write_eval_record(out, metrics=record.metrics, gates=record.gates, passed=record.passed, results=record.results)
    shutil.rmtree(source, ignore_errors=True)
    return out


def sliced_record(art: Artifacts, work: Path) -> Path:
    """The champion's eval record with one slice cut by ``SLICE_LOSS`` of its good outcomes: a harm category's
    refusals where the record has safety slices, else a task slice's right answers (the smallest slice the
    per-slice gate compares, short of the whole set), the metric's average lowered to match. A planted record, for
    a candidate whose weights are the champion's: the per-slice offline gate should catch it, while the average
    moves by the slice's share of the prompts only."""
    from serving.rollout.offline import OFFLINE_MIN_SAMPLES

    record = json.loads((art.champion / "eval_record.json").read_text())
    for metric in ("refusal_rate", "task_accuracy"):
        row = next((r for r in record.get("results") or [] if r.get("metric") == metric), None)
        slices = {label: s for label, s in ((row or {}).get("slices") or {}).items()
                  if OFFLINE_MIN_SAMPLES <= int(s.get("n") or 0) < int(row["n"])}
        if slices:
            break
    else:
        raise CalibrationError(f"{art.champion}/eval_record.json: no refusal_rate or task_accuracy slice of ≥ "
                               f"{OFFLINE_MIN_SAMPLES} prompts (short of the whole set) to plant a regression in")
    label = min(slices, key=lambda name: (int(slices[name]["n"]), name))
    cut = slices[label]
    lost = round(float(cut["value"]) * int(cut["n"]) * SLICE_LOSS)
    cut["value"] = float(cut["value"]) - lost / int(cut["n"])
    row["value"] = float(row["value"]) - lost / int(row["n"])
    record.setdefault("metrics", {})[metric] = row["value"]
    out = work / "records" / "slice" / "eval_record.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out
