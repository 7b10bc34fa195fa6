"""GRPO stage on `grpo_train.jsonl`: sample a group of replies per prompt with plain transformers generation,
score them with the verifiable rewards of training/rewards.py, and push the policy towards the better ones.

The KL reference is the stage's input model (LoRA adapters switched off); `beta: 0` drops it. The mean reward
per logging step is plotted to `reward_curve.png` (logged to MLflow) so "reward rises" can be seen, not assumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.lora import keep_adapters_fp32
from training.rewards import build_reward_functions
from training.stage_config import GRPOStageConfig, StageResult, TrainingError
from training.stages import EvalFn, StageContext, StageSpec, run_stage

PLOT_NAME = "reward_curve.png"


def _to_rows(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, record in enumerate(records, 1):
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise TrainingError(f"{path}: record {i}: 'prompt' must be a user message or a list of chat turns")
        rows.append({"prompt": prompt, "answer": str(record["answer"]), "task": str(record.get("task", "")),
                     "work": str(record.get("work", ""))})
    return rows


def _eos_ids(ctx: StageContext) -> list[int]:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(str(ctx.model_dir)).eos_token_id
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if ctx.tokenizer.eos_token_id is not None and ctx.tokenizer.eos_token_id not in ids:
        ids.append(ctx.tokenizer.eos_token_id)
    return ids


def _build_trainer(ctx: StageContext):
    from trl import GRPOConfig, GRPOTrainer

    cfg: GRPOStageConfig = ctx.config
    funcs, weights = build_reward_functions(cfg.correctness_weight, cfg.format_weight, cfg.length_penalty,
                                            cfg.length_target_tokens, _eos_ids(ctx), cfg.partial_credit_weight,
                                            cfg.work_weight)
    args = GRPOConfig(
        **{**ctx.args, "remove_unused_columns": False},  # the rewards read the `answer`, `task`, `work` columns
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=0,
        beta=cfg.beta,
        num_iterations=cfg.num_iterations,
        reward_weights=weights,
        use_vllm=False,
        log_completions=False,
        mask_truncated_completions=False,
    )
    trainer = GRPOTrainer(model=ctx.model, reward_funcs=funcs, args=args, train_dataset=ctx.dataset,
                          processing_class=ctx.tokenizer)
    keep_adapters_fp32(trainer.model, ctx.hw)
    return trainer


def reward_points(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row["reward"])) for row in history if "reward" in row and "step" in row]


def _after_train(ctx: StageContext, history: list[dict[str, Any]]) -> dict[str, float]:
    """Plot the reward curve and summarise it: mean reward over the first and the last third of the logs."""
    points = reward_points(history)
    if not points:
        return {}
    plot_reward_curve(history, ctx.output_dir / PLOT_NAME)
    ctx.artifacts.append(ctx.output_dir / PLOT_NAME)
    third = max(1, len(points) // 3)
    first = sum(r for _, r in points[:third]) / third
    last = sum(r for _, r in points[-third:]) / third
    return {"reward_first_third": first, "reward_last_third": last, "reward_gain": last - first}


def plot_reward_curve(history: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in [("reward", "total (weighted)"), ("rewards/correctness_reward/mean", "correctness"),
                       ("rewards/format_reward/mean", "format"),
                       ("rewards/partial_credit_reward/mean", "partial credit"),
                       ("rewards/work_reward/mean", "work lines")]:
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


GRPO_SPEC = StageSpec(name="grpo", data_file="grpo_train.jsonl", required_columns=("prompt", "answer"),
                      to_rows=_to_rows, build_trainer=_build_trainer, after_train=_after_train)


def run_grpo(config: GRPOStageConfig, model_dir: Path, data_dir: Path, output_dir: Path,
             evaluate: EvalFn | None = None) -> StageResult:
    """GRPO from `model_dir` (DPO's output; also the KL reference) on `data_dir/grpo_train.jsonl`."""
    return run_stage(GRPO_SPEC, config, model_dir, data_dir, output_dir, evaluate)
