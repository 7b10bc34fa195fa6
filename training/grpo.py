"""GRPO stage on `grpo_train.jsonl`: sample a group of replies per prompt with plain transformers generation,
score them with the verifiable rewards of training/rewards.py, and push the policy towards the better ones.

The KL reference is the stage's input model (LoRA adapters switched off); `beta: 0` drops it. The mean reward
per logging step, and greedy accuracy on held-out prompts every few steps (training/heldout_curve.py), are
plotted to `reward_curve.png` (logged to MLflow) so "reward rises" and "the skill improved" can be seen.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.common.stop_tokens import stop_token_ids
from training.engine_rollouts import EngineRollouts, engine_rollouts_trainer, why_not_engine
from training.finetune_stage import PreparedRecords, StageContext, StageSpec, run_finetune_stage
from training.heldout_curve import METRIC as HELDOUT_METRIC
from training.informative_groups import informative_groups_trainer
from training.lora import keep_adapters_fp32
from training.ranks import cuda_device_index, rank
from training.rewards import build_reward_functions
from training.sft_replay import load_replay_chats, replay_batches, sft_replay_trainer
from training.stage_config import GRPOStageConfig, StageResult, TrainingError

log = logging.getLogger(__name__)

PLOT_NAME = "reward_curve.png"


def _to_rows(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, record in enumerate(records, 1):
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise TrainingError(f"{path}: record {i}: 'prompt' must be a user message or a list of chat turns")
        should_refuse = record.get("should_refuse", False)
        if not isinstance(should_refuse, bool):
            raise TrainingError(f"{path}: record {i}: 'should_refuse' must be true or false")
        rows.append({"prompt": prompt, "answer": str(record["answer"]), "task": str(record.get("task", "")),
                     "work": str(record.get("work", "")), "should_refuse": should_refuse})
    return rows


def _build_trainer(ctx: StageContext):
    from trl import GRPOConfig, GRPOTrainer

    cfg: GRPOStageConfig = ctx.config
    stop_ids = stop_token_ids(ctx.model_dir, ctx.tokenizer)
    funcs, weights = build_reward_functions(cfg.correctness_weight, cfg.format_weight, cfg.length_penalty,
                                            cfg.length_target_tokens, stop_ids, cfg.partial_credit_weight,
                                            cfg.work_weight, cfg.refusal_weight)
    args = GRPOConfig(
        **{**ctx.args, "remove_unused_columns": False},  # the rewards read `answer`, `task`, `work`, `should_refuse`
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=0,
        beta=cfg.beta,
        num_iterations=cfg.num_iterations,
        loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards,
        top_entropy_quantile=cfg.top_entropy_quantile,
        reward_weights=weights,
        use_vllm=False,
        log_completions=False,
        mask_truncated_completions=False,
    )
    trainer_class = informative_groups_trainer(GRPOTrainer, cfg.keeps_safety_anchors) \
        if cfg.drop_uninformative_groups else GRPOTrainer
    if cfg.sft_replay_weight:
        trainer_class = sft_replay_trainer(trainer_class, _replay_batches(ctx), cfg.sft_replay_weight)
    rollouts = _engine_rollouts(ctx, args)
    if rollouts is not None:
        trainer_class = engine_rollouts_trainer(trainer_class, rollouts)
    trainer = trainer_class(model=ctx.model, reward_funcs=funcs, args=args, train_dataset=ctx.dataset,
                            processing_class=ctx.tokenizer)
    keep_adapters_fp32(trainer.model, ctx.hw)
    return trainer


def _replay_batches(ctx: StageContext) -> Iterator[dict[str, Any]]:
    """The SFT chats the loss replays (training.sft_replay), cut to the stage's ``max_seq_len``."""
    if ctx.data_dir is None:
        raise TrainingError("grpo.sft_replay_weight: the stage was given no data dir to read the SFT chats from")
    chats = load_replay_chats(ctx.data_dir, ctx.tokenizer, ctx.config.max_seq_len)
    pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else ctx.tokenizer.eos_token_id
    log.info("grpo: replaying %d SFT chats, %d a step, at weight %g", len(chats), ctx.config.sft_replay_batch,
             ctx.config.sft_replay_weight)
    return replay_batches(chats, ctx.config.sft_replay_batch, ctx.config.seed + rank(), pad)


def _engine_rollouts(ctx: StageContext, args: Any) -> EngineRollouts | None:
    """The serving engine that samples this stage's rollouts (training.engine_rollouts), or None for TRL's own
    generation: asked for, or (``auto``) because the engine cannot hold this policy exactly, which is logged."""
    cfg: GRPOStageConfig = ctx.config
    if cfg.rollout_backend == "transformers":
        return None
    reason = why_not_engine(cfg, ctx.model)
    if reason is not None:
        if cfg.rollout_backend == "engine":
            raise TrainingError(f"grpo.rollout_backend: engine: {reason}; set it to transformers or auto")
        log.info("grpo: rollouts sampled by transformers, not the serving engine: %s", reason)
        return None
    prompts = [ctx.tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=False)
               for row in ctx.dataset["prompt"]]
    longest = max(len(ids) for ids in ctx.tokenizer(prompts, add_special_tokens=False)["input_ids"])
    device = "cpu" if ctx.hw.device == "cpu" else f"cuda:{cuda_device_index()}"
    per_generation = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
    rollouts = EngineRollouts.start(ctx.model_dir, device=device, bf16=ctx.hw.bf16, rank=cfg.lora.r,
                                    max_seqs=per_generation, longest_prompt=longest,
                                    max_completion=cfg.max_completion_length, seed=cfg.seed + rank())
    log.info("grpo: rollouts sampled by the serving engine (%d replies a step, the adapter synced each step)",
             per_generation)
    return rollouts


def reward_points(history: list[dict[str, Any]], key: str = "reward") -> list[tuple[int, float]]:
    """(step, value) of every logged step; a step where the reward applied to no reply (TRL logs None: a step of
    safety prompts only has no correctness) is left out."""
    return [(int(row["step"]), float(row[key])) for row in history
            if row.get(key) is not None and "step" in row]


def _thirds(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Mean of the first and of the last third of a curve: single log rows are too noisy to compare."""
    third = max(1, len(points) // 3)
    return (sum(v for _, v in points[:third]) / third, sum(v for _, v in points[-third:]) / third)


HACKING_TOLERANCE = 0.02  # correctness drops smaller than this are sampling noise over a few hundred replies


@dataclass(frozen=True)
class RewardTrend:
    """How the weighted reward and plain answer correctness moved over a GRPO run (first vs last third)."""

    reward_first: float
    reward_last: float
    correct_first: float | None
    correct_last: float | None

    @property
    def hacked(self) -> bool:
        """The weighted reward rose while correctness fell: the shaping terms are being gamed.

        Why check: partial credit pays for answer characters in place, so a policy can raise it by writing
        one plausible answer to every prompt (seen here: every reply became ``Answer: 122`` after 200 steps
        at lr 2e-3, correctness 0.22 → 0.0, reward up). The reward curve alone then looks like success.
        """
        if self.correct_first is None or self.correct_last is None:
            return False
        return (self.reward_last > self.reward_first
                and self.correct_last < self.correct_first - HACKING_TOLERANCE)


def reward_trend(history: list[dict[str, Any]]) -> RewardTrend | None:
    points = reward_points(history)
    if not points:
        return None
    correct = reward_points(history, "rewards/correctness_reward/mean")
    reward_first, reward_last = _thirds(points)
    correct_first, correct_last = _thirds(correct) if correct else (None, None)
    return RewardTrend(reward_first, reward_last, correct_first, correct_last)


def _after_train(ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, float]:
    """Plot the reward curve, summarise it (first vs last third of the logs) and flag reward hacking."""
    trend = reward_trend(history)
    if trend is None:
        return {}
    plot_reward_curve(history, ctx.output_dir / PLOT_NAME)
    ctx.artifacts.append(ctx.output_dir / PLOT_NAME)
    metrics = {"reward_first_third": trend.reward_first, "reward_last_third": trend.reward_last,
               "reward_gain": trend.reward_last - trend.reward_first, "reward_hacking_suspected": float(trend.hacked)}
    if trend.correct_first is not None and trend.correct_last is not None:
        metrics.update(correctness_first_third=trend.correct_first, correctness_last_third=trend.correct_last)
    if trend.hacked:
        log.warning("grpo: the weighted reward rose %.3f -> %.3f while answer correctness fell %.3f -> %.3f: the "
                    "shaping rewards are being gamed; lower partial_credit_weight / format_weight or the learning "
                    "rate", trend.reward_first, trend.reward_last, trend.correct_first, trend.correct_last)
    return metrics


def plot_reward_curve(history: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in [("reward", "total (weighted)"), ("rewards/correctness_reward/mean", "correctness (sampled)"),
                       ("rewards/format_reward/mean", "format"),
                       ("rewards/partial_credit_reward/mean", "partial credit"),
                       ("rewards/work_reward/mean", "work lines"),
                       ("rewards/refusal_reward/mean", "refusal right"),
                       (HELDOUT_METRIC, "held-out greedy accuracy")]:
        pts = [(row["step"], row[key]) for row in history if key in row and "step" in row]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _prepare_records(config: GRPOStageConfig, model_dir: Path, records: list[dict[str, Any]], output_dir: Path,
                     fingerprint: str) -> PreparedRecords:
    """The prompts GRPO trains on: with ``solved_prompt_draws``, those its input model does not solve yet."""
    if not config.solved_prompt_draws:
        return PreparedRecords(records)
    from training.solved_prompts import SOLVED_FILE, unsolved_prompts

    kept, report = unsolved_prompts(config, model_dir, records, output_dir, fingerprint)
    return PreparedRecords(kept, report.metrics(), [Path(output_dir) / SOLVED_FILE])


GRPO_SPEC = StageSpec(name="grpo", data_file="grpo_train.jsonl", required_columns=("prompt", "answer"),
                      to_rows=_to_rows, build_trainer=_build_trainer, after_train=_after_train,
                      prepare_records=_prepare_records)


def run_grpo(config: GRPOStageConfig, model_dir: Path, data_dir: Path, output_dir: Path) -> StageResult:
    """GRPO from `model_dir` (DPO's output; also the KL reference) on `data_dir/grpo_train.jsonl`."""
    return run_finetune_stage(GRPO_SPEC, config, model_dir, data_dir, output_dir)
