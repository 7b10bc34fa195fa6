"""Who should write the pipeline's replies: our serving engine or ``transformers``' ``generate``? Side by side.

Three jobs the pipeline generates for, each timed both ways in turns (``--rounds``), in one process:

- **evals**: the generation suites of one eval run (greedy tasks and safety, ``--k`` sampled draws per task) on
  each model dir given (a stage output, a GPTQ/AWQ bundle): ``EvalConfig.generation_backend``;
- **rollouts**: one GRPO step's sampling (``--prompts`` × ``--group`` replies at T ``--temperature``, 32 tokens)
  under a rank-16 LoRA adapter with non-zero B: PEFT's ``generate`` against the engine with the adapter synced
  into its slot (``training.engine_rollouts``), sync included;
- accuracy of both on the same eval, so a speed-up that changed the scores would show.

    .venv/bin/python benchmarks/generation_backends.py --data RUN/data-KEY/data \\
        RUN/grpo-KEY/stage RUN/bundle-gptq-KEY/bundle --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from evals.config import EvalConfig  # noqa: E402
from evals.results import metrics_dict  # noqa: E402
from evals.runner import run_evals  # noqa: E402

BACKENDS = ("transformers", "engine")
SUITES = ["task_accuracy", "format_adherence", "sampled_task_accuracy", "safety"]


def time_evals(model_dir: Path, data_dir: Path, backend: str, k: int) -> tuple[float, dict[str, float]]:
    config = EvalConfig(suites=SUITES, max_new_tokens=32, batch_size=64, samples_per_prompt=k,
                        generation_backend=backend)
    started = time.perf_counter()
    scores = metrics_dict(run_evals(model_dir, data_dir, config))
    return time.perf_counter() - started, scores


def rollout_prompts(model_dir: Path, data_dir: Path, prompts: int, group: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in (data_dir / "grpo_train.jsonl").read_text().splitlines()[:prompts]]
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"] for r in rows]
    return [p for p in ids for _ in range(group)]


def rollout_timers(model_dir: Path, prompt_ids: list[list[int]], temperature: float):
    """Two callables, one GRPO step's sampling each way, on the same live adapter."""
    from transformers import GenerationConfig

    from training.engine_rollouts import EngineRollouts, RolloutSampling
    from training.hardware import Hardware
    from training.lora import attach_adapters, load_base_model
    from training.stage_config import LoraSettings

    settings = LoraSettings(r=16, alpha=32)
    torch.manual_seed(0)
    policy = attach_adapters(load_base_model(model_dir, settings, Hardware("cpu", False)), settings)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    policy.eval()
    tokenizer_pad = policy.config.pad_token_id or 0
    eos = list(policy.generation_config.eos_token_id or []) if isinstance(
        policy.generation_config.eos_token_id, list) else [policy.generation_config.eos_token_id]
    config = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                              pad_token_id=tokenizer_pad, eos_token_id=eos)
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), tokenizer_pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1

    def hf() -> None:
        with torch.no_grad():
            policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)

    rollouts = EngineRollouts.start(model_dir, device="cpu", bf16=False, rank=16, max_seqs=len(prompt_ids),
                                    longest_prompt=width, max_completion=32, seed=0)
    sampling = RolloutSampling(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                               max_tokens=32, stop_token_ids=tuple(eos))
    step = iter(range(1 << 30))

    def engine() -> None:
        rollouts.sync(policy, next(step))  # every step syncs, as in training
        rollouts.generate(prompt_ids, sampling)

    return {"transformers": hf, "engine": engine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, nargs="+", help="model dirs to evaluate (the first also samples rollouts)")
    parser.add_argument("--data", type=Path, required=True, help="the data stage's output dir")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=8, help="sampled replies per held-out task prompt")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    for model_dir in args.models:
        seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
        scores: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for backend in BACKENDS:
                s, scores[backend] = time_evals(model_dir, args.data, backend, args.k)
                seconds[backend].append(s)
        rows.append((f"evals: {model_dir.parent.name}/{model_dir.name}", seconds, scores))
    timers = rollout_timers(args.models[0], rollout_prompts(args.models[0], args.data, args.prompts, args.group),
                            args.temperature)
    seconds = {b: [] for b in BACKENDS}
    for _ in range(max(3, args.rounds)):
        for backend in BACKENDS:
            started = time.perf_counter()
            timers[backend]()
            seconds[backend].append(time.perf_counter() - started)
    rows.append((f"rollouts: {args.prompts} x {args.group} at T {args.temperature:g}", seconds, {}))

    print(f"\n{args.threads} torch threads; seconds, median of {args.rounds} rounds in turns (min-max)\n")
    print("| job | transformers s | engine s | engine / transformers | greedy acc (t / e) | sampled acc (t / e) | "
          "refusal (t / e) |")
    print("|---|---:|---:|---:|---|---|---|")
    for label, seconds, scores in rows:
        t, e = (statistics.median(seconds[b]) for b in BACKENDS)
        cells = [f"{t:.1f} ({min(seconds['transformers']):.1f}-{max(seconds['transformers']):.1f})",
                 f"{e:.1f} ({min(seconds['engine']):.1f}-{max(seconds['engine']):.1f})", f"{e / t:.2f}"]
        for metric in ("task_accuracy", "sampled_task_accuracy", "refusal_rate"):
            cells.append(" / ".join(f"{scores[b][metric]:.3f}" for b in BACKENDS) if scores else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
