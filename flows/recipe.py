"""The pipeline recipe: one YAML file, one dataclass per section, owned by the stage it configures.

`load_recipe` is the only way a recipe enters the program; it rejects unknown keys and bad values
with a one-line `ConfigError` naming the file and the dotted key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from artifacts.common.config_loader import build_dataclass, read_yaml_mapping
from artifacts.errors import ConfigError
from artifacts.writer import BundleConfig
from evals.config import EvalConfig
from evals.gates import Gate, parse_gate
from quantize.config import QuantizeConfig
from serving.rollout.plan import RolloutPlan
from training.base_model import BaseModelConfig
from training.data import DataConfig
from training.draft_config import DraftConfig
from training.stage_config import KEYS_THAT_MATTER, DPOStageConfig, GRPOStageConfig, SFTStageConfig

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class BaseSection:
    """Where the pipeline's base model comes from: the embedded tiny model, or a local HF directory."""

    source: str = "embedded"
    embedded: BaseModelConfig = field(default_factory=BaseModelConfig)

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("source: 'embedded' or the path of a local Hugging Face model directory")

    @property
    def is_embedded(self) -> bool:
        return self.source == "embedded"


@dataclass
class TrainingSection:
    """SFT → DPO → GRPO; each stage starts from the previous enabled stage's merged model."""

    sft: SFTStageConfig = field(default_factory=SFTStageConfig)
    dpo: DPOStageConfig = field(default_factory=DPOStageConfig)
    grpo: GRPOStageConfig = field(default_factory=GRPOStageConfig)


@dataclass
class RegistrySection:
    """MLflow registered model that receives each bundle as a version."""

    enabled: bool = True
    model_name: str = ""  # empty: the recipe's name
    # The alias given to a freshly registered bundle whose gates pass; promotion to `champion`
    # is a separate, deliberate step (the gateway's rollout or a person in the MLflow UI).
    candidate_alias: str = "candidate"
    # Which bundle variant ("fp", "gptq", "awq") receives the alias; empty: the first quantized method.
    ship_variant: str = ""


@dataclass
class FleetSection:
    """The fleet the pipeline's rollout stage starts (and stops): a gateway on this machine, and replicas on the
    backend: ``local`` (processes on 127.0.0.1) or ``ray`` (Ray actors on the cluster at ``ray_address``)."""

    threads: int = 1  # torch threads per replica (a Ray replica reserves as many CPUs)
    kv_memory: str = "64MiB"
    gateway_port: int = 0  # 0: a free port
    backend: str = "local"
    ray_address: str = ""  # empty: $RAY_ADDRESS, else auto (the cluster `ray start` began on this machine)
    gateways: list[str] = field(default_factory=list)  # other gateways in front of the same replicas (base URLs)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "ray"):
            raise ValueError(f"backend: must be 'local' or 'ray', got {self.backend!r}")


@dataclass
class TrafficSection:
    """Replayed held-out prompts while the rollout runs."""

    users: int = 200  # distinct conversation keys: a 10% canary step needs ~100 to see its min_keys (10) a side
    concurrency: int = 4
    max_tokens: int = 40
    stream_fraction: float = 0.8
    temperature: float = 0.0
    requests_per_second: float | None = None  # a cap, so each canary step sees the same traffic on any host

    def __post_init__(self) -> None:
        if self.users < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("users, concurrency and max_tokens must be >= 1")
        if self.requests_per_second is not None and not self.requests_per_second > 0:
            raise ValueError(f"requests_per_second: must be > 0 (or left out), got {self.requests_per_second}")
        if not 0 <= self.stream_fraction <= 1:
            raise ValueError(f"stream_fraction: must be in [0, 1], got {self.stream_fraction}")


@dataclass
class RolloutSection:
    """What the pipeline does with a candidate that passed its gates."""

    mode: str = "auto"  # auto: roll it out now on a local fleet; manual: stop at `candidate`; off
    plan: RolloutPlan = field(default_factory=RolloutPlan)
    fleet: FleetSection = field(default_factory=FleetSection)
    traffic: TrafficSection = field(default_factory=TrafficSection)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "manual", "off"):
            raise ValueError(f"mode: must be 'auto', 'manual' or 'off', got {self.mode!r}")


RELEASE_FORMS = ("merged", "adapter")


@dataclass
class ReleaseSection:
    """What the pipeline ships: ``merged``, the final model with every stage's adapter merged into it (a snapshot
    of its own); or ``adapter``, the stages' adapters stacked into one (training.adapter_stack) and bundled against
    the base the first stage started from, so one replica of the base serves it beside other adapters. The adapter
    is registered under ``adapter_model`` (empty: the registered model's name + ``-adapter``) with the base's
    version in its lineage, and gated on the evals of base + adapter as the engine serves them."""

    form: str = "merged"
    adapter_model: str = ""

    def __post_init__(self) -> None:
        if self.form not in RELEASE_FORMS:
            raise ValueError(f"form: must be one of {', '.join(RELEASE_FORMS)}, got {self.form!r}")
        if self.adapter_model and not _NAME_RE.match(self.adapter_model):
            raise ValueError(f"adapter_model: {self.adapter_model!r} must be 1-64 letters, digits, '.', '_' or '-'")


RUNNER_KINDS = ("local", "ray")


@dataclass
class RunnerSection:
    """Where the flow's stage tasks run: ``local`` (in the flow's own process) or ``ray`` (each stage a task on
    the Ray cluster at ``address``, through prefect-ray; flows/ray_runner.py). Stages still talk through the
    workdir, so on a cluster of several machines it must be on storage every node mounts at the same path."""

    kind: str = "local"
    # ray: HOST:PORT of the head (`ray start --head` prints it), ray://HOST:10001, `local` (a Ray instance
    # started for this run alone), or empty: $RAY_ADDRESS, else `auto` (the cluster started on this machine)
    address: str = ""

    def __post_init__(self) -> None:
        if self.kind not in RUNNER_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(RUNNER_KINDS)}, got {self.kind!r}")
        if self.address and self.kind != "ray":
            raise ValueError(f"address: only a ray runner has one (kind is {self.kind!r})")


@dataclass
class Recipe:
    name: str = "tiny-default"
    workdir: Optional[str] = None
    threads: int = 0  # torch threads for every stage (0 = leave torch's choice)
    base: BaseSection = field(default_factory=BaseSection)
    data: DataConfig = field(default_factory=DataConfig)
    evals: EvalConfig = field(default_factory=EvalConfig)
    training: TrainingSection = field(default_factory=TrainingSection)
    quantize: Optional[QuantizeConfig] = field(default_factory=QuantizeConfig)  # null: ship full precision only
    # A distilled draft of the final model for `serve --speculative-model`; absent or null: none is built.
    draft: Optional[DraftConfig] = None
    bundle: BundleConfig = field(default_factory=lambda: BundleConfig(name="tiny-default"))
    registry: RegistrySection = field(default_factory=RegistrySection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    # Promotion gates on the final eval record, e.g. "task_accuracy >= 0.4".
    gates: list[str] = field(default_factory=list)
    runner: RunnerSection = field(default_factory=RunnerSection)
    release: ReleaseSection = field(default_factory=ReleaseSection)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name: {self.name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0, got {self.threads}")
        for text in self.gates:
            parse_gate(text)
        if self.release.form == "adapter":
            self._check_adapter_release()

    def _check_adapter_release(self) -> None:
        """What the adapter form cannot ship, said before any stage runs."""
        stages = [name for name in ("sft", "dpo", "grpo") if getattr(self.training, name).enabled]
        if not stages:
            raise ValueError("release.form: 'adapter' needs at least one enabled training stage (its adapter is "
                             "what ships)")
        qlora = [name for name in stages if getattr(self.training, name).lora.qlora]
        if qlora:
            raise ValueError(f"release.form: 'adapter' with training.{qlora[0]}.lora.qlora: true: a QLoRA adapter "
                             "learned on the 4-bit NF4 base, so stacked on the full-precision base bundle it is not "
                             "the model the evals measured; set qlora: false or release.form: merged")
        if self.quantize is not None:
            raise ValueError("release.form: 'adapter' ships against the full-precision base bundle; set quantize: "
                             "null (a quantized base under the adapter is served by the engine but not yet "
                             "evaluated as served by the pipeline)")
        if self.draft is not None:
            raise ValueError("release.form: 'adapter' ships no merged model for a draft to imitate; set draft: null")
        if self.adapter_model_name == self.registered_model_name:
            raise ValueError(f"release.adapter_model: {self.adapter_model_name!r} is the base's registered model; "
                             "an adapter is registered under a model of its own")

    def parsed_gates(self) -> list[Gate]:
        return [parse_gate(text) for text in self.gates]

    @property
    def registered_model_name(self) -> str:
        return self.registry.model_name or self.name

    @property
    def adapter_model_name(self) -> str:
        """The registered model the adapter form's versions go to."""
        return self.release.adapter_model or f"{self.registered_model_name}-adapter"


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; relative paths inside it are taken relative to the recipe file."""
    path = Path(path)
    data = read_yaml_mapping(path)
    bundle = data.get("bundle")
    if bundle is None or isinstance(bundle, dict):  # the bundle is named after the recipe unless told
        data["bundle"] = {"name": data.get("name", Recipe.name), **(bundle or {})}
    recipe = build_dataclass(Recipe, data, key="", source=path)
    base = recipe.base
    if not base.is_embedded:
        candidate = Path(base.source).expanduser()
        if not candidate.is_absolute():
            candidate = (path.parent / candidate).resolve()
        if not candidate.is_dir():
            raise ConfigError(f"{path}: base.source: {base.source!r} is neither 'embedded' nor a directory")
        base.source = str(candidate)
    return recipe


def untuned_keys(path: str | Path) -> list[str]:
    """One line per enabled training stage of the recipe at ``path`` that leaves out a key known to matter
    (``KEYS_THAT_MATTER``): the run still starts, on defaults tuned for the embedded base, and the user is told
    which values to set. Read from the file itself: the loaded recipe cannot tell a default from a value."""
    path = Path(path)
    data = read_yaml_mapping(path)
    training = data.get("training") or {}
    lines = []
    for stage, keys in KEYS_THAT_MATTER.items():
        section = training.get(stage) if isinstance(training, dict) else None
        if isinstance(section, dict) and section.get("enabled", True) is False:
            continue
        given = section if isinstance(section, dict) else {}
        missing = [k for k in keys if k not in given]
        if missing:
            defaults = _STAGE_CLASSES[stage]()
            values = ", ".join(f"{k}={getattr(defaults, k)}" for k in missing)
            lines.append(f"{path}: training.{stage}: {', '.join(missing)} not set, so the defaults ({values}) "
                         "apply; set them for your model (configs/default.yaml has the values tuned for the "
                         "embedded base)")
    return lines


_STAGE_CLASSES = {"sft": SFTStageConfig, "dpo": DPOStageConfig, "grpo": GRPOStageConfig}
