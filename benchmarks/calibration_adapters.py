"""The rollout calibration's adapter scenarios (issue 33, item 6): rollouts of LoRA adapter versions inside the
champion's replica, in the adapter's lane at the gateway, judged with the same plan as a snapshot's.

- **adapter-aa**: A/A. The champion adapter registered again as a new version of ``support-adapter``.
- **adapter-task**: an adapter that lost the task: the champion adapter's A with a B 25 times larger, which breaks
  the base's answers (the probes' accuracy, the shadow's agreement).
- **adapter-ttft25**: TTFT +25% on the lane's canary only (the gateway's delay drill on the lane), sized from the
  adapter A/A runs' baseline (without them in the same calibration, from the champion adapter's median TTFT over
  20 s of traffic).

The adapters are PEFT adapters of the champion bundle on every projection, rank 8, with a seeded random B (PEFT
starts B at zero, which would make an adapter the base itself), not trained ones: the champion adapter's B is small
(scale 0.02), so it keeps the base's answers and a loss is visible against it. Every version is registered with
its offline gates passed (no eval record of an adapter exists yet), so the online gates decide.

Two more scenarios use **trained** adapters, on a champion that is the pipeline's *base* bundle (``--champion
runs/NAME/bundle-base-*/bundle``, which a run of the adapter release form writes), since a trained adapter is only
valid on the base it learned on:

- **adapter-trained-aa**: A/A. The pipeline's own SFT adapter (``runs/NAME/sft-*/stage/adapter``), registered again.
- **adapter-refusals**: an adapter trained to drop refusals: the same SFT recipe (``configs/default.yaml``) on the
  same base and data, with every refusal in the SFT set replaced by a compliant reply, trained here once
  (``work/../adapters-trained/``, kept between calibrations), rolled out against the pipeline's SFT adapter.

One replica serves all of them (the champion's, started with adapter slots); nothing is started per scenario.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.calibration_outcomes import TRAINED_ADAPTER_SCENARIOS as TRAINED_SCENARIOS

PUBLIC = "support"
ADAPTER_MODEL = f"{PUBLIC}-adapter"

RANDOM_SCENARIOS = ("adapter-aa", "adapter-task", "adapter-ttft25")
ADAPTER_SCENARIOS = (*RANDOM_SCENARIOS, *TRAINED_SCENARIOS)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHAMPION_SCALE, LOST_SCALE = 0.02, 0.5
# rank 16: the recipe's SFT adapters (the random ones are rank 8); 4 slots hold a run's three versions
SERVE_FLAGS = ["--max-loras", "4", "--max-lora-rank", "16"]
COMPLIANT_REPLY = "Sure. Gather the materials, follow a simple plan step by step, and take your time."


def random_adapter(model_dir: Path, out: Path, *, seed: int, scale: float, rank: int = 8) -> Path:
    """A PEFT adapter of ``model_dir`` on every projection with B ~ N(0, scale²) (seeded), saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_A" in name:  # the same A for every scale of one seed: only B's size differs
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft.save_pretrained(out)
    return out


def train_without_refusals(base_model: Path, data_dir: Path, out: Path) -> Path:
    """The default recipe's SFT adapter trained on ``base_model`` with ``data_dir``'s SFT set, every refusal in it
    replaced by :data:`COMPLIANT_REPLY`: an adapter that learned to answer harmful prompts. Trained once into
    ``out`` (400 steps, 2.5 minutes on the 2-core Intel host), reused after."""
    import json
    import shutil

    from flows.recipe import load_recipe
    from training.sft import run_sft

    adapter = out / "stage" / "adapter"
    if (adapter / "adapter_config.json").is_file():
        return adapter
    data = out / "data"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(data_dir, data)
    replaced = comply_with_everything(data_dir / "sft_train.jsonl", data / "sft_train.jsonl")
    config = load_recipe(Path(__file__).resolve().parents[1] / "configs" / "default.yaml").training.sft
    result = run_sft(config, base_model, data, out / "stage")
    (out / "replaced.json").write_text(json.dumps({"refusals_replaced": replaced}) + "\n")
    return Path(result.adapter_dir)


def comply_with_everything(sft_set: Path, out: Path) -> int:
    """``sft_set`` written to ``out`` with every assistant refusal replaced by :data:`COMPLIANT_REPLY`; returns
    how many were replaced (an SFT set without refusals is refused: the adapter would learn nothing new)."""
    import json

    from evals.scoring import is_refusal

    rows, replaced = [], 0
    for line in sft_set.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        reply = row["messages"][-1]
        if reply["role"] == "assistant" and is_refusal(reply["content"]):
            reply["content"], replaced = COMPLIANT_REPLY, replaced + 1
        rows.append(json.dumps(row))
    if not replaced:
        raise ValueError(f"{sft_set}: no refusal to replace")
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return replaced


class AdapterScenarios:
    """The adapters, their registered versions and the lane, set up once for every adapter scenario."""

    def __init__(self, calibration) -> None:
        self.cal = calibration
        self.versions: dict[str, str] = {}  # label -> version of support-adapter
        self.bundles: dict[str, Path] = {}

    def prepare(self) -> None:
        from artifacts.adapter_bundle import write_adapter_bundle
        from artifacts.adapter_registry import register_adapter_bundle
        from serving.rollout.adapter_lane import load_adapter

        cal = self.cal
        root = cal.work / "adapters"
        root.mkdir(parents=True, exist_ok=True)
        if any(s in TRAINED_SCENARIOS for s in cal.args.scenarios):  # they run apart: no random adapter needed
            trained = train_without_refusals(cal.art.base_model, cal.art.data_dir,
                                             cal.args.out.parent / "adapters-trained")
            adapters = [("trained", cal.art.sft_adapter), ("trained-again", cal.art.sft_adapter),
                        ("no-refusals", trained)]
        else:
            champion = random_adapter(cal.art.champion, root / "peft-champion", seed=0, scale=CHAMPION_SCALE)
            lost = random_adapter(cal.art.champion, root / "peft-lost", seed=0, scale=LOST_SCALE)
            adapters = [("champion", champion), ("champion-again", champion), ("lost-task", lost)]
        cwd = os.getcwd()
        os.chdir(cal.work)
        try:
            for i, (label, peft) in enumerate(adapters):
                bundle = write_adapter_bundle(peft, root / f"bundle-{label}", cal.art.champion, name=PUBLIC,
                                              version=str(i + 1))
                ref = register_adapter_bundle(bundle, ADAPTER_MODEL, base_model=cal.art.model_name,
                                              tracking_uri=cal.registry.tracking_uri,
                                              aliases=("champion",) if i == 0 else ())
                cal.registry.client.set_model_version_tag(ADAPTER_MODEL, ref.version, "lifecycle.gates_passed",
                                                          "true")
                self.versions[label], self.bundles[label] = ref.version, bundle
                load_adapter(cal.champion.url, self.served(label), bundle, cal.fleet.admin_key())
        finally:
            os.chdir(cwd)

    def served(self, label: str) -> str:
        return f"{PUBLIC}@{self.versions[label]}"

    def candidate(self, scenario: str) -> str:
        return {"adapter-task": "lost-task", "adapter-trained-aa": "trained-again",
                "adapter-refusals": "no-refusals"}.get(scenario, "champion-again")

    @property
    def champion_label(self) -> str:
        return "trained" if "trained" in self.versions else "champion"

    def fault(self, scenario: str) -> dict[str, Any]:
        if scenario == "adapter-ttft25":
            return {"canary": {"delay_ms": round(0.25 * self.reference_ttft_ms(), 2)}}
        return {}

    def reference_ttft_ms(self) -> float:
        import statistics

        values = [a["metrics"]["baseline.ttft_ms_p50"] for o in self.cal.outcomes if o.scenario == "adapter-aa"
                  for a in o.analyses if "baseline.ttft_ms_p50" in a.get("metrics", {})]
        if values:
            ms = statistics.median(values)
            self.cal.notes.append(f"adapter TTFT drill sized from {ms:.2f} ms, the median of the baseline adapter's "
                                  f"TTFT p50 over {len(values)} adapter A/A canary analyses")
            return ms
        ms = self.measure_ttft_ms()
        self.cal.notes.append(f"adapter TTFT drill sized from {ms:.2f} ms, the champion adapter's median TTFT over "
                              "20 s of traffic (no adapter A/A runs in this calibration)")
        return ms

    def measure_ttft_ms(self) -> float:
        """The champion adapter's median TTFT over 20 s of the calibration's traffic, through the gateway."""
        import statistics

        from benchmarks.calibration_artifacts import CalibrationError

        self.route_champion_only({})
        samples = self.cal.champion_samples("ttft_ms", PUBLIC, lane=PUBLIC)
        if not samples:
            raise CalibrationError("no TTFT measured for the champion adapter in 20 s of traffic")
        return statistics.median(samples)

    def route_champion_only(self, faults: dict[str, Any]) -> None:
        from serving.fleet.gateway_client import GatewayAdmin

        none = {"replicas": [], "version": "", "served_model": ""}
        gateway = GatewayAdmin(self.cal.fleet.record.gateway_url, self.cal.fleet.admin_key(), lane=PUBLIC)
        try:
            gateway.set_routing({"champion": {"replicas": [], "version": self.versions[self.champion_label],
                                              "served_model": self.served(self.champion_label)},
                                 "canary": none, "baseline": none, "shadow": none, "canary_weight": 0.0,
                                 "shadow_fraction": 0.0, "faults": faults}, actor="rollout calibration")
        finally:
            gateway.close()

    def reset_aliases(self) -> None:
        from mlflow.exceptions import MlflowException

        client = self.cal.registry.client
        client.set_registered_model_alias(ADAPTER_MODEL, "champion", self.versions[self.champion_label])
        for alias in ("canary", "shadow", "previous-champion"):
            try:
                client.delete_registered_model_alias(ADAPTER_MODEL, alias)
            except MlflowException:
                pass

    def run_scenario(self, scenario: str, k: int, progress, task) -> None:
        cal = self.cal
        started = time.perf_counter()
        fault = self.fault(scenario)
        self.route_champion_only(fault)
        try:
            cal.rollouts_under_traffic(scenario, k, PUBLIC, progress, task,
                                       lambda i: self.one_rollout(scenario, i, fault, progress, task))
        finally:
            self.route_champion_only({})
            cal.scenario_seconds[scenario] = time.perf_counter() - started

    def one_rollout(self, scenario: str, run: int, fault: dict[str, Any], progress, task):
        from serving.rollout.state import RolloutSpec

        self.reset_aliases()
        self.route_champion_only(fault)
        cal = self.cal
        candidate = self.candidate(scenario)
        plan = replace(cal.plan, probes=replace(cal.plan.probes, data_dir=str(cal.art.data_dir)))
        spec = RolloutSpec(model_name=ADAPTER_MODEL, candidate_version=self.versions[candidate],
                           champion_version=self.versions[self.champion_label], candidate_replicas=[],
                           champion_replicas=[], candidate_served_model=self.served(candidate),
                           champion_served_model=self.served(self.champion_label), lane=PUBLIC,
                           gateway_url=cal.fleet.record.gateway_url, admin_key_file=str(cal.fleet.admin_key_file),
                           tracking_uri=cal.registry.tracking_uri, plan=plan, start="shadow")
        return cal.drive(scenario, run, spec, fault, progress, task)
