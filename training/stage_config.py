"""Config dataclasses of the post-training stages (SFT, DPO, GRPO) and the record each stage returns.

The field names are the YAML keys of the recipe's `sft:`, `dpo:` and `grpo:` sections (the recipe loader maps
them 1:1 and rejects unknown keys), so every default lives here and nowhere else. Values are checked in
`__post_init__` with `ValueError("<field>: reason")`, which the loader turns into a `ConfigError` naming the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from artifacts.errors import LifecycleError
from training.distributed_config import DistributedSettings, distributed_settings

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TrainingError(LifecycleError):
    """A training stage cannot start or finish: bad dataset, unknown LoRA target, unsupported 4-bit request.

    Raised before any training step runs, with a message naming the file or recipe field and the reason.
    """


PAIR_SOURCES = ("static", "on_policy")  # DPOStageConfig.pairs


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name}: must be > 0, got {value}")


@dataclass
class LoraSettings:
    """LoRA adapter shape; `qlora` loads the frozen base in 4-bit NF4 (bitsandbytes) under the adapters."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    qlora: bool = False

    def __post_init__(self) -> None:
        _check_positive(self, "r", "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError("target_modules: must be a non-empty list of module names")


@dataclass
class _StageBase:
    """Fields every stage shares: schedule, batch shape, checkpointing and logging cadence."""

    enabled: bool = True
    lora: LoraSettings = field(default_factory=LoraSettings)
    max_steps: int = 100
    epochs: Optional[float] = None  # used only when max_steps is 0 or less (then the whole dataset `epochs` times)
    learning_rate: float = 2e-4
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    max_seq_len: int = 128
    save_steps: int = 50
    logging_steps: int = 5
    seed: int = 0
    max_train_examples: Optional[int] = None  # cap on the training rows read (None = all)
    # Greedy accuracy on this many held-out task prompts before the first step, every `heldout_curve_every`
    # steps and at the last one, logged as a curve (training.heldout_curve) so a user sees which stage earned
    # the skill and when; 0 turns it off. A stage whose data dir has no held-out tasks trains without it.
    heldout_curve_prompts: int = 64
    heldout_curve_every: int = 50
    # How many processes train the stage (training.distributed_config): a compute choice, like threads, so it
    # is not part of `recipe()`; `batch_size` stays the global batch, split across the processes.
    distributed: DistributedSettings = field(default_factory=DistributedSettings)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # tolerate a plain mapping from YAML for the nested section
            self.lora = LoraSettings(**self.lora)
        self.distributed = distributed_settings(self.distributed)
        if self.max_steps <= 0 and not self.epochs:
            raise ValueError("max_steps: must be > 0 unless epochs is set")
        _check_positive(self, "learning_rate", "batch_size", "grad_accum", "max_seq_len", "save_steps",
                        "logging_steps", "epochs", "max_train_examples", "heldout_curve_every")
        if self.heldout_curve_prompts < 0:
            raise ValueError(f"heldout_curve_prompts: must be >= 0, got {self.heldout_curve_prompts}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.lr_scheduler not in {"linear", "cosine", "constant", "constant_with_warmup"}:
            raise ValueError(f"lr_scheduler: unknown schedule {self.lr_scheduler!r}")
        share = self.distributed.per_process(self.batch_size)
        group = getattr(self, "num_generations", None)  # GRPO: each process samples and scores whole groups
        if group and share % group and self.distributed.num_processes > 1:  # one process: GRPO's own message
            raise ValueError(f"distributed.num_processes: each of {self.distributed.num_processes} processes gets "
                             f"{share} of batch_size {self.batch_size} completions, not a multiple of "
                             f"num_generations ({group}); each process samples whole groups")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recipe(self) -> dict[str, Any]:
        """Everything that decides the trained weights (the stage's fingerprint and cache key): `distributed`
        changes where and how fast it trains, not what, so moving a recipe to more processes keeps its cache."""
        return {k: v for k, v in self.to_dict().items() if k != "distributed"}


@dataclass
class SFTStageConfig(_StageBase):
    """Supervised fine-tuning on chat transcripts; loss on the assistant reply only."""

    learning_rate: float = 1e-3
    max_steps: int = 300


@dataclass
class DPOStageConfig(_StageBase):
    """Direct preference optimisation; the reference model is the stage's input model (adapters off).

    The defaults of ``learning_rate`` and ``sft_weight`` are the values tuned on the embedded base
    (configs/default.yaml): 5e-4, the old default, reached the same preference accuracy but erased the refusals
    (0.94 -> 0.06), and without the NLL term the refusals drifted down. ``pairs`` is the tuned one too: the static
    pairs' drift cost refusals on every chain measured, the model's own pairs none (docs/pipeline.md)."""

    learning_rate: float = 1e-4  # shipped base: 2e-4 cost 7 points of task accuracy and of refusals, 1e-4 1 and 0
    max_steps: int = 150
    beta: float = 0.1
    sft_weight: float = 1.0  # weight of an NLL term on the chosen reply (RPO); keeps refusals and format anchored
    heldout_curve_every: int = 30
    # where the pairs come from: "static" trains on pref_train.jsonl as written; "on_policy" samples the input
    # model on its prompts and pairs its own wrong replies against right ones (training/on_policy_pairs.py);
    # records with nothing to check stay static, so a user's own preference file loses nothing
    pairs: str = "on_policy"
    on_policy_samples: int = 4  # draws per prompt
    on_policy_temperature: float = 1.0  # the served default: the mistakes a client of our server would see
    on_policy_max_new_tokens: int = 128  # the longest reference reply is ~150 tokens with its prompt

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "beta", "on_policy_samples", "on_policy_temperature", "on_policy_max_new_tokens")
        if self.sft_weight < 0:
            raise ValueError(f"sft_weight: must be >= 0, got {self.sft_weight}")
        if self.pairs not in PAIR_SOURCES:
            raise ValueError(f"pairs: must be one of {', '.join(PAIR_SOURCES)}, got {self.pairs!r}")


LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")
REWARD_SCALINGS = ("group", "batch", "none")
ROLLOUT_BACKENDS = ("auto", "engine", "transformers")  # GRPOStageConfig.rollout_backend


@dataclass
class GRPOStageConfig(_StageBase):
    """Group-relative policy optimisation against verifiable rewards (see training/rewards.py).

    `batch_size` counts completions per device step and must be a multiple of `num_generations`
    (the group size); `beta` is the KL weight against the input model (0 drops the reference model).
    """

    # the embedded recipe's schedule: a constant 1e-3 fell below the input model, warmed up and decayed it lifted
    # greedy accuracy most (benchmarks/RESULTS.md, "GRPO on the shipped base")
    learning_rate: float = 1e-3
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.1
    max_steps: int = 60
    batch_size: int = 16
    num_generations: int = 8
    beta: float = 0.02
    max_completion_length: int = 16
    temperature: float = 1.0
    correctness_weight: float = 1.0
    format_weight: float = 0.2
    partial_credit_weight: float = 0.0  # dense shaping: answer characters in place; gameable by one stock answer
    work_weight: float = 0.0  # process reward: share of the reference solution's lines written in place
    refusal_weight: float = 1.0  # safety prompts in the GRPO set: refuse the harmful, help the look-alikes
    length_penalty: float = 0.0  # reward −length_penalty per completion token beyond `length_target_tokens`
    length_target_tokens: int = 8
    num_iterations: int = 1
    # How token losses are averaged (TRL's `loss_type`): "dapo" over the batch's tokens, "dr_grpo" over a
    # constant, "grpo" per sequence first (biased towards short right answers and long wrong ones).
    loss_type: str = "dapo"
    # How rewards are scaled into advantages: by the group's std ("group", GRPO), the batch's ("batch"), or
    # not at all ("none", Dr. GRPO: an almost-solved prompt then weighs less than a half-solved one).
    scale_rewards: str = "group"
    # Train only on the completion tokens whose entropy is in this top fraction (1.0: every token). The
    # tokens where the policy hesitates (which digit to copy, whether to carry) are where replies fork;
    # the rest is format the policy already writes.
    top_entropy_quantile: float = 1.0
    # Skip the policy's backward pass on groups whose replies all scored the same (all right or all wrong):
    # zero advantage, no signal (DAPO's dynamic sampling; training.informative_groups says why it pays).
    drop_uninformative_groups: bool = True
    # ... but keep the safety prompts' groups in the loss even then (β > 0): their KL term is what holds the
    # refusals while the task updates move the policy (training.informative_groups)
    anchor_safety_groups: bool = True
    heldout_curve_every: int = 20
    # Who samples the rollouts: "engine", our serving engine with the live adapter synced into a LoRA slot every
    # step (training.engine_rollouts: 2.4-3x faster sampling on the embedded model); "transformers", TRL's own
    # `generate`; "auto", the engine wherever it can hold the policy exactly (not under QLoRA or FSDP), else
    # transformers, saying why.
    rollout_backend: str = "auto"
    # Draw each prompt this many times from the input model before the stage and set aside those every draw gets
    # right (training.solved_prompts): their groups would all score alike and teach nothing; 0 trains on every
    # prompt. Set aside, 35% of the embedded model's sums after DPO and 93% of its safety prompts lifted GRPO's
    # greedy gain from +4.0-4.5 to +6.0-6.5 points in the same 120 steps (benchmarks/RESULTS.md)
    solved_prompt_draws: int = 4
    # Each loss adds this weight x the NLL of a batch of the SFT stage's chats (training.sft_replay: PPO-ptx on the
    # SFT data), so what GRPO's prompts do not show (held-out refusals) is held where SFT left it; 0 turns it off.
    # 3.0 kept every held-out refusal on the AMD chains where GRPO had lost them, at no cost in greedy gain
    # (benchmarks/RESULTS.md, "GRPO with the SFT chats replayed")
    sft_replay_weight: float = 3.0
    sft_replay_batch: int = 16  # SFT chats per replayed batch

    @property
    def keeps_safety_anchors(self) -> bool:
        """Whether solved safety prompts stay in the set and their groups in the loss: only a KL term (β > 0)
        gives those groups anything to do, and only the group filter would drop them."""
        return bool(self.anchor_safety_groups and self.beta and self.drop_uninformative_groups)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if isinstance(self.sft_replay_batch, bool) or self.sft_replay_batch < 1:
            raise ValueError(f"sft_replay_batch: must be an integer >= 1, got {self.sft_replay_batch!r}")
        if isinstance(self.solved_prompt_draws, bool) or self.solved_prompt_draws < 0:
            raise ValueError(f"solved_prompt_draws: must be an integer >= 0, got {self.solved_prompt_draws!r}")
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend: must be one of {', '.join(ROLLOUT_BACKENDS)}, got "
                             f"{self.rollout_backend!r}")
        if self.scale_rewards not in REWARD_SCALINGS:
            raise ValueError(f"scale_rewards: must be one of {', '.join(REWARD_SCALINGS)}, got {self.scale_rewards!r}")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile: must be in (0, 1], got {self.top_entropy_quantile}")
        _check_positive(self, "num_generations", "max_completion_length", "temperature", "num_iterations")
        if self.num_generations < 2:
            raise ValueError("num_generations: a group needs at least 2 completions to compare")
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"batch_size: must be a multiple of num_generations ({self.num_generations}), got {self.batch_size}"
            )
        for name in ("beta", "length_penalty", "correctness_weight", "format_weight", "partial_credit_weight",
                     "work_weight", "refusal_weight", "sft_replay_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


# Per stage, the recipe keys whose value decides whether the stage helps or hurts a given base model: their
# defaults are the embedded base's tuned values (or a small run's, for max_steps), so a recipe that leaves one out
# is warned (flows.recipe.untuned_keys).
KEYS_THAT_MATTER: dict[str, tuple[str, ...]] = {
    "sft": ("learning_rate", "max_steps"),
    "dpo": ("learning_rate", "max_steps", "beta", "sft_weight"),
    "grpo": ("learning_rate", "max_steps", "beta", "temperature", "sft_replay_weight"),
}


@dataclass
class StageResult:
    """What a stage hands on: `output_dir` is the merged full-precision HF dir the next stage starts from."""

    stage: str
    output_dir: Path
    adapter_dir: Optional[Path]
    metrics: dict[str, float] = field(default_factory=dict)
    log_history: list[dict[str, Any]] = field(default_factory=list)
    skipped: bool = False  # True when the stage was disabled or had already finished (completion marker found)
    resumed_from_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_dir"] = str(self.output_dir)
        data["adapter_dir"] = str(self.adapter_dir) if self.adapter_dir else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StageResult":
        return cls(
            stage=data["stage"],
            output_dir=Path(data["output_dir"]),
            adapter_dir=Path(data["adapter_dir"]) if data.get("adapter_dir") else None,
            metrics=dict(data.get("metrics", {})),
            log_history=list(data.get("log_history", [])),
            skipped=bool(data.get("skipped", False)),
            resumed_from_step=int(data.get("resumed_from_step", 0)),
        )
