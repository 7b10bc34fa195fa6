"""GRPO's rollouts sampled by our own serving engine, the policy's live LoRA weights in one of its adapter slots.

Why: a GRPO step samples a group of replies for every prompt before it can score or train anything, and with
plain ``transformers`` generation that sampling was the largest share of the stage (38% of a step on the
embedded model, py-spy). The engine (serving.engine) decodes the same 128 replies 2.4-3x faster: paged KV,
one batched forward per token for every reply, LoRA as two small matmuls per fused projection.

How: the engine loads the stage's *input* model, which is also the trained model's frozen base (and GRPO's KL
reference), once. Before the first generation of every optimizer step the adapter's current A and B matrices
are copied into a fresh ``LoraAdapter`` under a new digest (a few MB; residency and prefix caching key on the
digest, so no block computed under older weights is ever reused), and every rollout request runs on it. This
is TRL's vLLM "colocate" scheme, with only the adapter synced, not the merged weights.

What stays with ``transformers`` (``GRPOStageConfig.rollout_backend: auto`` says why in the log): a 4-bit
(QLoRA) base, which the engine would sample in full precision, i.e. off-policy; FSDP, where no process holds
the whole adapter; adapters the engine cannot hold (DoRA, targets outside the seven Llama projections, a rank
above the engine's slot); models the engine's compact forward does not run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.stage_config import TrainingError

log = logging.getLogger(__name__)

ADAPTER_NAME = "policy"
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@dataclass(frozen=True)
class RolloutSampling:
    """How each rollout is sampled: the trainer's own settings, so both backends draw from one distribution."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int
    stop_token_ids: tuple[int, ...]  # a reply ends on the first of these, and keeps it (as TRL's mask does)


def why_not_engine(config: Any, model: Any) -> str | None:
    """The reason this stage's rollouts cannot run on the engine, or None when they can."""
    if config.lora.qlora:
        return "the base is 4-bit (QLoRA): the engine would sample its full-precision weights, off-policy"
    if config.distributed.enabled and config.distributed.strategy == "fsdp":
        return "FSDP shards the adapter across processes"
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is None:
        return "the model has no LoRA adapter named 'default'"
    if getattr(peft_config, "use_dora", False):
        return "DoRA adapters are not served by the engine"
    targets = set(getattr(peft_config, "target_modules", None) or ())
    if not targets <= PROJECTIONS:
        return f"LoRA targets {sorted(targets - PROJECTIONS)} are outside the Llama projections the engine adapts"
    if getattr(peft_config, "modules_to_save", None):
        return "modules_to_save trains whole modules the engine does not sync"
    return None


def adapter_weights(model: Any) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], int, float]:
    """The live adapter as the engine holds it: (layer, projection) -> (A [r, in], B [out, r]), with its rank
    and scaling, read from the PEFT model's LoRA layers (a detached copy, so training goes on untouched)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    ranks, scalings = set(), set()
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if lora_a is None or lora_b is None or "default" not in lora_a:
            continue
        parts = name.split(".")
        if "layers" not in parts:
            continue
        at = parts.index("layers")
        layer, projection = int(parts[at + 1]), parts[-1]
        if projection not in PROJECTIONS:
            raise TrainingError(f"rollout_backend: engine: LoRA layer {name} is not a Llama projection")
        a = lora_a["default"].weight.detach().to(torch.float32).clone()
        b = lora_b["default"].weight.detach().to(torch.float32).clone()
        weights[(layer, projection)] = (a, b)
        ranks.add(a.shape[0])
        scalings.add(float(module.scaling["default"]))
    if not weights:
        raise TrainingError("rollout_backend: engine: the model has no LoRA layers to sync")
    if len(ranks) != 1 or len(scalings) != 1:
        raise TrainingError(f"rollout_backend: engine: one rank and scaling for every layer expected, got ranks "
                            f"{sorted(ranks)} and scalings {sorted(scalings)}")
    return weights, ranks.pop(), scalings.pop()


def cache_blocks(max_seqs: int, longest_prompt: int, max_completion: int, block_size: int) -> int:
    """KV blocks for ``max_seqs`` replies at once, each at its longest: the engine never has to preempt, and on a
    GPU it takes that and no more (sized by the device instead, it would claim the trainer's memory)."""
    per_seq = math.ceil((longest_prompt + max_completion) / block_size) + 1
    return max_seqs * per_seq


class EngineRollouts:
    """One engine for the whole stage; ``sync`` before a step's first generation, then ``generate``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.synced_step: int | None = None
        self.syncs = 0

    @classmethod
    def start(cls, model_dir: Path, *, device: str, bf16: bool, rank: int, max_seqs: int, longest_prompt: int,
              max_completion: int, seed: int) -> EngineRollouts:
        from serving.engine.config import EngineConfig
        from serving.engine.engine import LLMEngine
        from serving.engine.errors import EngineError

        block_size = 16
        config = EngineConfig(
            device=device, dtype="bfloat16" if bf16 else "float32", block_size=block_size,
            num_blocks=cache_blocks(max_seqs, longest_prompt, max_completion, block_size),
            max_num_seqs=max_seqs, max_queue=max(256, max_seqs),
            max_num_batched_tokens=max(2048, max_seqs * min(longest_prompt, 64)),
            max_loras=1, max_lora_rank=rank, seed=seed, threads=None)
        try:
            engine = LLMEngine.from_pretrained(model_dir, config)
        except (EngineError, ValueError, OSError) as exc:
            raise TrainingError(f"rollout_backend: engine: {model_dir} does not load in the serving engine "
                                f"({exc}); set grpo.rollout_backend: transformers") from None
        return cls(engine)

    def sync(self, model: Any, step: int) -> None:
        """Put the adapter's weights of optimizer step ``step`` in the engine (once per step)."""
        if self.synced_step == step:
            return
        from serving.engine.lora import LoraAdapter

        weights, rank, scaling = adapter_weights(model)
        manager = self.engine.runner.lora
        if ADAPTER_NAME in manager.registered:
            manager.unregister(ADAPTER_NAME)
        self.syncs += 1
        manager.register(LoraAdapter(ADAPTER_NAME, "(the trainer's live adapter)", rank, scaling, weights,
                                     digest=f"step-{step}-sync-{self.syncs}"))
        self.synced_step = step

    def generate(self, prompt_ids: list[list[int]], sampling: RolloutSampling) -> list[list[int]]:
        """One reply per prompt (prompts repeat once per group member); each ends on its stop token when it
        stopped, as TRL's own generation leaves it, else at ``max_tokens``."""
        from serving.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
                                max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids),
                                ignore_eos=True, skip_special_tokens=False)
        outputs = self.engine.generate([list(ids) for ids in prompt_ids], params,
                                       loras=[ADAPTER_NAME] * len(prompt_ids))
        replies = []
        for out in outputs:
            if out.error is not None:
                raise TrainingError(f"rollout_backend: engine: a rollout failed ({out.error})")
            replies.append(list(out.token_ids))  # a stop token is the reply's last
        return replies


def engine_rollouts_trainer(base: type, rollouts: EngineRollouts) -> type:
    """A subclass of TRL's ``GRPOTrainer`` (or of a subclass of it) whose text-only rollouts come from
    ``rollouts``; anything else (images, multimodal fields) goes to TRL's own generation."""

    class EngineRolloutsGRPOTrainer(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            if images is not None or multimodal_fields or has_tool_images:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            rollouts.sync(self.accelerator.unwrap_model(self.model), self.state.global_step)
            sampling = RolloutSampling(
                temperature=float(self.temperature), top_p=float(self.top_p if self.top_p is not None else 1.0),
                top_k=int(self.top_k or 0), min_p=float(self.min_p or 0.0),
                repetition_penalty=float(self.repetition_penalty or 1.0),
                max_tokens=int(self.max_completion_length), stop_token_ids=tuple(int(i) for i in self.eos_token_ids))
            return rollouts.generate(prompt_ids, sampling), None

    return EngineRolloutsGRPOTrainer
