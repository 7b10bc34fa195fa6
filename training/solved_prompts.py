"""GRPO trains on the prompts its input model has not solved yet: each prompt drawn ``solved_prompt_draws``
times first, and a prompt every draw gets right set aside (``GRPOStageConfig.solved_prompt_draws``).

Why: a group whose replies all earn the same reward teaches nothing (``training.informative_groups`` skips its
backward pass), and a prompt the policy already solves at the sampling temperature almost always gives such a
group. On the embedded model after DPO, 35% of the GRPO task prompts and 93% of its safety prompts came back
right in 4 of 4 draws at T 0.5, and 40% of every step's groups were dropped as uninformative: the step spent
its sampling and its reference pass on them and trained on the rest. Set aside before the stage, they leave every
step's batch to prompts that can still teach (DAPO's dynamic sampling, done once up front instead of with a
refill each step); a prompt the policy only *may* solve stays in, since one wrong draw keeps it. Solved safety
prompts stay too (with ``anchor_safety_groups`` and β > 0): their groups are the KL term's hold on the refusals
(training.informative_groups).

What "right" means is the on-policy DPO miner's judge (training.on_policy_pairs.judge_for): the record's answer
for a task, its ``should_refuse`` for a safety prompt, and a reply cut by the token limit is never right. The
draws run at the stage's own temperature and completion length, through the serving engine where it loads the
model (evals.engine_generation). The kept prompts are written to the stage's output dir under the stage's
fingerprint, so a resumed stage trains on the very prompts its checkpoints saw.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json

log = logging.getLogger(__name__)

SOLVED_FILE = "solved_prompts.json"


@dataclass
class SolvedReport:
    """What the draws found, for the stage's metrics."""

    prompts: int
    draws: int
    temperature: float
    solved: dict[str, int] = field(default_factory=dict)  # kind -> prompts every draw got right (set aside)
    anchors: int = 0  # safety prompts every draw got right, kept for the KL term
    kept: dict[str, int] = field(default_factory=dict)  # kind -> prompts trained on
    unverifiable: int = 0  # prompts without an answer to check: kept
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        out = {"solved_prompts": float(sum(self.solved.values())), "kept_prompts": float(sum(self.kept.values())),
               "solved_anchor_prompts": float(self.anchors), "solved_prompt_seconds": self.seconds}
        out.update({f"solved_prompts_{kind}": float(n) for kind, n in self.solved.items()})
        out.update({f"kept_prompts_{kind}": float(n) for kind, n in self.kept.items()})
        return out


def split_solved(records: list[dict[str, Any]], samples: list[list[tuple[str, bool]]], judges: list[Any],
                 temperature: float, keep_kinds: tuple[str, ...] = ()) -> tuple[list[int], SolvedReport]:
    """Indices of the records to train on (in order) and the report; a prompt whose judge's kind is in
    ``keep_kinds`` stays even when solved. Pure: the tests drive it with hand-written draws ((text, stopped on
    eos) each)."""
    report = SolvedReport(prompts=len(records), draws=max((len(s) for s in samples), default=0),
                          temperature=temperature)
    kept: list[int] = []
    for i, (draws, judge) in enumerate(zip(samples, judges, strict=True)):
        if judge is None:
            report.unverifiable += 1
            kept.append(i)
            continue
        if draws and all(judge.accepts(text, finished) for text, finished in draws):
            if judge.kind not in keep_kinds:
                report.solved[judge.kind] = report.solved.get(judge.kind, 0) + 1
                continue
            report.anchors += 1
        report.kept[judge.kind] = report.kept.get(judge.kind, 0) + 1
        kept.append(i)
    return kept, report


def unsolved_prompts(config: Any, model_dir: Path, records: list[dict[str, Any]], output_dir: Path,
                     fingerprint: str) -> tuple[list[dict[str, Any]], SolvedReport]:
    """The records GRPO trains on: read back from ``output_dir`` when drawn for this fingerprint, else drawn now
    and written there (atomically) before any training step."""
    from training.on_policy_pairs import judge_for, sample_replies
    from training.ranks import is_worker
    from training.stage_config import TrainingError

    path = Path(output_dir) / SOLVED_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            saved = {}
        if saved.get("fingerprint") == fingerprint and saved.get("records") == len(records):
            return [records[i] for i in saved["kept"]], SolvedReport(**saved["report"])
    if is_worker():  # each rank drawing its own would train the ranks on different prompts
        raise TrainingError(f"{path}: no solved-prompt draws for this stage; the launching process draws them "
                            "before it starts the workers")
    started = time.perf_counter()
    judges = [judge_for({**r, "chosen": "", "rejected": ""}) for r in records]
    verifiable = [i for i, j in enumerate(judges) if j is not None]
    drawn = sample_replies(model_dir, [_turns(records[i]["prompt"]) for i in verifiable], config.solved_prompt_draws,
                           config.temperature, config.max_completion_length, config.seed, desc="solved-prompt draw")
    samples: list[list[tuple[str, bool]]] = [[] for _ in records]
    for i, draws in zip(verifiable, drawn, strict=True):
        samples[i] = draws
    # solved safety prompts stay as the KL term's anchors for the refusals (GRPOStageConfig.anchor_safety_groups)
    keep = ("safety",) if config.keeps_safety_anchors else ()
    kept, report = split_solved(records, samples, judges, config.temperature, keep)
    report.seconds = round(time.perf_counter() - started, 2)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"fingerprint": fingerprint, "records": len(records), "report": asdict(report),
                             "kept": kept})
    log.info("grpo: %d of %d prompts solved in every one of %d draws at T %g, set aside (%s); training on %d",
             sum(report.solved.values()), report.prompts, report.draws, report.temperature, report.solved, len(kept))
    return [records[i] for i in kept], report


def _turns(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
