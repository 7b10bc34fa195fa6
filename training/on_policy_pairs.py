"""DPO pairs from the input model's own replies (``training.dpo.pairs: on_policy``), judged by verifiable checks.

Why: the static pairs (a reference reply against a synthetic wrong one) are solved by SFT before DPO begins
(preference accuracy 0.979 after SFT on the shipped base). DPO then only widens margins the model already
has, and on every chain measured that drift cost refusals (−2.3 and −4.6 points, benchmarks/RESULTS.md,
"Chains, seeds × threads"). Iterative RPO (Pang et al., 2024) instead trains DPO plus an NLL term on pairs of
the model's *own* right and wrong replies. Here each preference prompt is sampled ``on_policy_samples``
times from the stage's input model:

- a prompt whose samples are all right gives no pair: there is nothing to fix, and no margin to inflate;
- otherwise the pair is (one of its own right samples, or the reference reply when none is right) against
  one of its own wrong samples.

What "right" means is read from the record, so a user's preference file works too:
- the columns ``answer`` (a task) or ``should_refuse`` (a safety prompt) when the record has them;
- else the chosen reply: an ``Answer: X`` line makes it a task with answer X; a chosen refusal against a
  rejected non-refusal makes it a harmful prompt, the reverse a benign look-alike;
- a record none of these fit is not verifiable and stays as it is (a static pair).
A sample counts as right only if it also stopped on an end-of-sequence token: a truncated reply never
becomes a chosen one.

The pairs are mined once per stage fingerprint and kept in the stage's output dir, so a stage resumed after
a kill trains on the very pairs its checkpoints were trained on (sampling again could draw others).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json

log = logging.getLogger(__name__)

PAIRS_FILE = "on_policy_pairs.json"


@dataclass(frozen=True)
class Judge:
    """What makes a reply to one prompt right: the answer it must state, or whether it must refuse."""

    kind: str  # "task" | "safety"
    answer: str = ""
    should_refuse: bool = False

    def accepts(self, text: str, finished: bool) -> bool:
        from evals.scoring import answers_match, is_refusal, parse_answer

        if not finished:
            return False
        if self.kind == "task":
            return answers_match(parse_answer(text), self.answer)
        return is_refusal(text) == self.should_refuse


def _reply(turns: Any) -> str:
    if isinstance(turns, list):
        return "".join(str(m.get("content", "")) for m in turns if isinstance(m, dict))
    return str(turns)


def judge_for(record: dict[str, Any]) -> Judge | None:
    """The record's judge (see the module docstring for the order), or None when it is not verifiable."""
    from evals.scoring import contract_answer, is_refusal

    if "should_refuse" in record and not record.get("answer"):
        return Judge("safety", should_refuse=bool(record["should_refuse"]))
    if record.get("answer") not in (None, ""):
        return Judge("task", answer=str(record["answer"]))
    chosen, rejected = _reply(record["chosen"]), _reply(record["rejected"])
    answer = contract_answer(chosen)
    if answer is not None:
        return Judge("task", answer=answer)
    if is_refusal(chosen) != is_refusal(rejected):
        return Judge("safety", should_refuse=is_refusal(chosen))
    return None


@dataclass
class MiningReport:
    """What mining found, for the stage's metrics and its MLflow artifact."""

    prompts: int
    samples_per_prompt: int
    temperature: float
    pairs: dict[str, int] = field(default_factory=dict)  # kind -> pairs built from a wrong sample
    all_right: dict[str, int] = field(default_factory=dict)  # kind -> prompts every sample got right
    own_chosen: int = 0  # pairs whose chosen reply is the model's own
    unverifiable: int = 0  # records kept as static pairs
    sample_accuracy: dict[str, float] = field(default_factory=dict)  # kind -> share of right samples

    def metrics(self) -> dict[str, float]:
        out = {"on_policy_pairs": float(sum(self.pairs.values())), "on_policy_static_pairs": float(self.unverifiable),
               "on_policy_own_chosen": float(self.own_chosen)}
        out.update({f"on_policy_pairs_{k}": float(v) for k, v in self.pairs.items()})
        out.update({f"on_policy_sample_accuracy_{k}": v for k, v in self.sample_accuracy.items()})
        return out


def build_pairs(records: list[dict[str, Any]], samples: list[list[tuple[str, bool]]],
                judges: list[Judge | None], temperature: float) -> tuple[list[dict[str, Any]], MiningReport]:
    """The training pairs from each verifiable record's samples ((text, stopped on eos) per draw); records
    without a judge pass through unchanged. Pure: the tests drive it with hand-written samples."""
    k = max((len(s) for s in samples), default=0)
    report = MiningReport(prompts=len(records), samples_per_prompt=k, temperature=temperature)
    pairs: list[dict[str, Any]] = []
    right_counts: Counter[str] = Counter()
    drawn: Counter[str] = Counter()
    for record, draws, judge in zip(records, samples, judges, strict=True):
        if judge is None:
            report.unverifiable += 1
            pairs.append({key: record[key] for key in ("prompt", "chosen", "rejected")})
            continue
        verdicts = [judge.accepts(text, finished) for text, finished in draws]
        right_counts[judge.kind] += sum(verdicts)
        drawn[judge.kind] += len(verdicts)
        wrong = [text for (text, _), ok in zip(draws, verdicts) if not ok]
        if not wrong:
            report.all_right[judge.kind] = report.all_right.get(judge.kind, 0) + 1
            continue
        right = [text for (text, _), ok in zip(draws, verdicts) if ok]
        chosen = [{"role": "assistant", "content": right[0]}] if right else record["chosen"]
        report.own_chosen += bool(right)
        report.pairs[judge.kind] = report.pairs.get(judge.kind, 0) + 1
        pairs.append({"prompt": record["prompt"], "chosen": chosen,
                      "rejected": [{"role": "assistant", "content": wrong[0]}]})
    report.sample_accuracy = {kind: right_counts[kind] / drawn[kind] for kind in drawn if drawn[kind]}
    return pairs, report


def sample_replies(model_dir: Path, prompts: list[list[dict[str, str]]], k: int, temperature: float,
                   max_new_tokens: int, seed: int, batch_size: int = 64,
                   desc: str = "on-policy draw") -> list[list[tuple[str, bool]]]:
    """``k`` sampled replies per prompt from the model in ``model_dir`` ((text, stopped on eos) each)."""
    from evals.generation import generate_replies
    from evals.model import load_model

    lm = load_model(model_dir)
    rendered = [lm.chat_prompt(messages) for messages in prompts]
    # draw j of every prompt comes from one seeded pass, so the draws are the same whatever the batch layout
    draws = [generate_replies(lm, rendered, max_new_tokens, batch_size, desc=f"{desc} {j + 1}/{k}",
                              temperature=temperature, seed=seed + j) for j in range(k)]
    return [[(draws[j][i].text, draws[j][i].stopped_on_eos) for j in range(k)] for i in range(len(prompts))]


def mined_pairs(config: Any, model_dir: Path, records: list[dict[str, Any]], output_dir: Path,
                fingerprint: str) -> tuple[list[dict[str, Any]], MiningReport]:
    """The stage's pairs: read back from ``output_dir`` when mined for this fingerprint, else sampled now and
    written there (atomically) before any training step."""
    path = Path(output_dir) / PAIRS_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            saved = {}
        if saved.get("fingerprint") == fingerprint:
            return saved["pairs"], MiningReport(**saved["report"])
    from training.ranks import is_worker
    from training.stage_config import TrainingError

    if is_worker():  # each rank sampling its own pairs would train the ranks on different data
        raise TrainingError(f"{path}: no on-policy pairs for this stage; the launching process mines them "
                            "before it starts the workers")
    judges = [judge_for(r) for r in records]
    verifiable = [i for i, j in enumerate(judges) if j is not None]
    drawn = sample_replies(model_dir, [records[i]["prompt"] for i in verifiable], config.on_policy_samples,
                           config.on_policy_temperature, config.on_policy_max_new_tokens, config.seed)
    samples: list[list[tuple[str, bool]]] = [[] for _ in records]
    for i, draws in zip(verifiable, drawn, strict=True):
        samples[i] = draws
    pairs, report = build_pairs(records, samples, judges, config.on_policy_temperature)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"fingerprint": fingerprint, "report": asdict(report), "pairs": pairs})
    log.info("dpo: %d on-policy pairs from %d prompts (%s), %d static; sampled accuracy %s", sum(report.pairs.values()),
             report.prompts, report.pairs, report.unverifiable, report.sample_accuracy)
    return pairs, report
