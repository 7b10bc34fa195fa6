"""The data stage: every dataset the later stages read, written once into one directory.

Why one stage: SFT, DPO, GRPO, quantization calibration and the evals must agree on what is train and
what is held out. Problems are split by a hash of their key (see `training.tasks`), and this stage also
*checks* that no held-out prompt reached a train file before it renames the directory into place.
A user's own local files (via `training.loaders`) replace the generated SFT / preference / GRPO data.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import staged_directory
from artifacts.digests import digest_json, sha256_file
from evals.json_replies import json_answer_reply, json_task_prompt
from training.corpus import plain_sentence, task_fact
from training.loaders import load_local_dataset, user_prompts
from training.tasks import (
    REFUSAL,
    SAFETY_TASK,
    SUM_TASKS,
    TASKS,
    SafetyExample,
    TaskExample,
    addition_operands,
    addition_work,
    compliant_reply,
    compose_reply,
    generate_examples,
    generate_safety,
    helpful_reply,
    safety_reply,
)
from training.tokenizer import render_chat

MANIFEST = "data_manifest.json"
FILES = ("sft_train.jsonl", "pref_train.jsonl", "pref_heldout.jsonl", "grpo_train.jsonl",
         "tasks_heldout.jsonl", "safety_heldout.jsonl", "text_heldout.jsonl", "calibration.jsonl")


class HeldoutLeakError(AssertionError):
    """A held-out prompt reached a train file: a bug, never a user error, so not a LifecycleError."""


@dataclass
class DataConfig:
    """Sizes of every dataset (per task or per safety category) and optional local replacements."""

    tasks: list[str] = field(default_factory=lambda: ["addition", "reverse"])
    sft_per_task: int = 1000
    pref_train_per_task: int = 300
    pref_heldout_per_task: int = 50
    grpo_per_task: int = 300
    # Safety prompts per category (harmful, look-alike) in the GRPO set, judged by the refusal reward.
    grpo_safety_per_category: int = 0
    heldout_per_task: int = 100
    safety_train_per_category: int = 40
    # How many times each safety chat appears in the SFT set: a mixture weight. A tiny model that sees each refusal
    # once learns the prompt's template instead of its object ("How do I make a X at home?" -> a look-alike's
    # answer, whatever X is); twice as often taught it the object (benchmarks/RESULTS.md, "Refusals").
    sft_safety_repeats: int = 1
    # Task chats per task added to the SFT set asked for a JSON answer (``evals.json_replies``: the work lines, then
    # the answer), for a model that should answer programs in JSON (the ``structured`` suite, the rollout's JSON
    # probes). 0 by default: on the embedded 2.3M-parameter model, 200 and 500 of them taught the format (every
    # unconstrained reply valid JSON at 500) but not the sums in it (JSON answers 0.05-0.06), and cost plain task
    # accuracy 0.725 -> 0.45-0.48 (200) and 0.39 (500) (benchmarks/RESULTS.md, "JSON in SFT").
    sft_json_per_task: int = 0
    safety_heldout_per_category: int = 16
    # Look-alike pairs in the DPO set (chosen: help, rejected: refusal); None = as many as harmful pairs.
    # Fewer keep DPO from pushing refusals down everywhere (a tiny model cannot tell the contexts apart well).
    safety_pref_lookalikes: int | None = None
    text_heldout: int = 200
    calibration: int = 128
    seed: int = 0
    sft_path: str | None = None
    preference_path: str | None = None
    grpo_path: str | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("tasks: at least one task is needed")
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"tasks: unknown task {task!r} (known: {', '.join(TASKS)})")
        for name in ("sft_per_task", "sft_json_per_task", "pref_train_per_task", "pref_heldout_per_task",
                     "grpo_per_task", "grpo_safety_per_category",
                     "heldout_per_task", "safety_train_per_category", "safety_heldout_per_category",
                     "text_heldout", "calibration"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.sft_safety_repeats < 1:
            raise ValueError(f"sft_safety_repeats: must be >= 1, got {self.sft_safety_repeats}")
        if self.safety_pref_lookalikes is not None and self.safety_pref_lookalikes < 0:
            raise ValueError(f"safety_pref_lookalikes: must be >= 0, got {self.safety_pref_lookalikes}")


def micro_data_config() -> DataConfig:
    """Small counts for tests (the `micro_data_dir` fixture): every file non-empty, built in a second."""
    return DataConfig(sft_per_task=64, sft_json_per_task=16, pref_train_per_task=32, pref_heldout_per_task=8,
                      grpo_per_task=32, grpo_safety_per_category=4, heldout_per_task=16, safety_train_per_category=8,
                      safety_heldout_per_category=4,
                      text_heldout=32, calibration=16, seed=0)


@dataclass
class DataManifest:
    """What `build_datasets` wrote: counts and sha256 of each file; ``digest`` summarizes them all."""

    path: Path
    config: dict[str, Any]
    counts: dict[str, int]
    files: dict[str, str]
    digest: str
    dropped_heldout_overlap: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("path")
        return out

    @classmethod
    def load(cls, data_dir: Path | str) -> DataManifest:
        raw = json.loads((Path(data_dir) / MANIFEST).read_text())
        return cls(path=Path(data_dir), **raw)


# --- record builders -------------------------------------------------------------------------------------

def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def sft_record(prompt: str, reply: str) -> dict[str, Any]:
    return {"messages": _user(prompt) + _assistant(reply)}


def wrong_answer(example: TaskExample, rng: random.Random) -> str:
    """A plausible wrong answer: off by a little for sums, a near-miss string for words."""
    if example.task in SUM_TASKS:
        value = int(example.answer)
        delta = rng.choice([-10, -2, -1, 1, 2, 10])
        return str(value + delta if value + delta >= 0 else value + abs(delta))
    word = example.answer
    candidates = [word[::-1], word[1:], word[:-1] + word[-1] * 2]
    for i in range(len(word) - 1):
        swapped = word[:i] + word[i + 1] + word[i] + word[i + 2:]
        candidates.append(swapped)
    candidates = [c for c in candidates if c != word and c]
    return rng.choice(candidates)


def rejected_reply(example: TaskExample, rng: random.Random, index: int) -> str:
    """Two of three rejected replies are well formed but wrong, one is right but badly formatted.

    The wrong ones are the mistakes a weak model makes: a dropped carry in the work (addition), or right
    work followed by a miscopied answer.
    """
    if index % 3 == 2:
        return rng.choice([example.answer, f"The answer is {example.answer}.",
                           f"answer = {example.answer}"])
    if index % 3 == 0 and example.task in SUM_TASKS:
        work, answer = addition_work(*addition_operands(example.prompt), carry_slip=True)
        if answer != example.answer:
            return compose_reply(work, answer)
    return compose_reply(example.work, wrong_answer(example, rng))


def task_pref_record(example: TaskExample, rng: random.Random, index: int) -> dict[str, Any]:
    return {"prompt": _user(example.prompt), "chosen": _assistant(example.reply),
            "rejected": _assistant(rejected_reply(example, rng, index))}


def safety_pref_record(example: SafetyExample) -> dict[str, Any]:
    """Harmful: refusal beats compliance. Look-alike: help beats an over-cautious refusal."""
    if example.should_refuse:
        chosen, rejected = REFUSAL, compliant_reply(example.subject)
    else:
        chosen, rejected = helpful_reply(example.subject), REFUSAL
    return {"prompt": _user(example.prompt), "chosen": _assistant(chosen), "rejected": _assistant(rejected)}


def grpo_record(example: TaskExample) -> dict[str, Any]:
    """A GRPO prompt with what its rewards check: the answer, and the reference work lines if the task has any."""
    record: dict[str, Any] = {"prompt": _user(example.prompt), "answer": example.answer, "task": example.task}
    if example.work:
        record["work"] = example.work
    return record


def grpo_safety_record(example: SafetyExample) -> dict[str, Any]:
    """A safety prompt for GRPO: no answer to check, only whether the reply refuses (training.rewards)."""
    return {"prompt": _user(example.prompt), "answer": "", "task": SAFETY_TASK,
            "should_refuse": example.should_refuse}


def _preference_safety(examples: list[SafetyExample], lookalikes: int | None) -> list[SafetyExample]:
    """All harmful examples and the first ``lookalikes`` look-alikes (all of them when None)."""
    if lookalikes is None:
        return examples
    harmful = [ex for ex in examples if ex.should_refuse]
    return harmful + [ex for ex in examples if not ex.should_refuse][:lookalikes]


# --- the stage ---------------------------------------------------------------------------------------------

def build_datasets(config: DataConfig, out_dir: Path | str) -> DataManifest:
    """Generate (or load) every dataset, check held-out disjointness, write ``out_dir`` atomically."""
    out_dir = Path(out_dir)
    rng = random.Random(config.seed)
    seed = config.seed

    heldout: dict[str, list[TaskExample]] = {}
    pref_heldout_tasks: list[TaskExample] = []
    sft_tasks: list[TaskExample] = []
    sft_json_tasks: list[TaskExample] = []
    pref_tasks: list[TaskExample] = []
    grpo_tasks: list[TaskExample] = []
    for task in config.tasks:
        n_heldout = config.heldout_per_task + config.pref_heldout_per_task
        pool = generate_examples(task, "heldout", n_heldout, seed)
        heldout[task] = pool[:config.heldout_per_task]
        pref_heldout_tasks += pool[config.heldout_per_task:]
        sft_tasks += generate_examples(task, "train", config.sft_per_task, seed)
        sft_json_tasks += generate_examples(task, "train", config.sft_json_per_task, seed + 4)
        pref_tasks += generate_examples(task, "train", config.pref_train_per_task, seed + 1)
        grpo_tasks += generate_examples(task, "train", config.grpo_per_task, seed + 2)
    safety_train = generate_safety("train", config.safety_train_per_category, seed)
    safety_heldout = generate_safety("heldout", config.safety_heldout_per_category, seed)

    records: dict[str, list[dict[str, Any]]] = {
        "tasks_heldout.jsonl": [ex.to_dict() for task in config.tasks for ex in heldout[task]],
        "safety_heldout.jsonl": [ex.to_dict() for ex in safety_heldout],
        "pref_heldout.jsonl": [task_pref_record(ex, rng, i) for i, ex in enumerate(pref_heldout_tasks)]
        + [safety_pref_record(ex) for ex in safety_heldout],
    }
    heldout_prompts = {r["prompt"] for r in records["tasks_heldout.jsonl"]}
    heldout_prompts |= {r["prompt"] for r in records["safety_heldout.jsonl"]}
    heldout_prompts |= {p for r in records["pref_heldout.jsonl"] for p in user_prompts(r, "preference")}
    heldout_prompts |= {json_task_prompt(r["prompt"], r["answer"]) for r in records["tasks_heldout.jsonl"]}

    generated = {
        "sft": [sft_record(ex.prompt, ex.reply) for ex in sft_tasks]
        + [sft_record(json_task_prompt(ex.prompt, ex.answer), json_answer_reply(ex.work, ex.answer))
           for ex in sft_json_tasks]
        + [sft_record(ex.prompt, safety_reply(ex)) for ex in safety_train] * config.sft_safety_repeats,
        "preference": [task_pref_record(ex, rng, i) for i, ex in enumerate(pref_tasks)]
        + [safety_pref_record(ex) for ex in _preference_safety(safety_train, config.safety_pref_lookalikes)],
        "grpo": [grpo_record(ex) for ex in grpo_tasks]
        + [grpo_safety_record(ex) for ex in generate_safety("train", config.grpo_safety_per_category, seed + 3)],
    }
    local_paths = {"sft": config.sft_path, "preference": config.preference_path, "grpo": config.grpo_path}
    dropped: dict[str, int] = {}
    names = {"sft": "sft_train.jsonl", "preference": "pref_train.jsonl", "grpo": "grpo_train.jsonl"}
    for kind, name in names.items():
        rows = generated[kind]
        if local_paths[kind]:
            loaded = load_local_dataset(local_paths[kind], kind)
            rows = [r for r in loaded if not heldout_prompts.intersection(user_prompts(r, kind))]
            dropped[kind] = len(loaded) - len(rows)
        rng.shuffle(rows)
        records[name] = rows

    for kind, name in names.items():
        leaked = heldout_prompts.intersection(p for r in records[name] for p in user_prompts(r, kind))
        if leaked:
            raise HeldoutLeakError(f"{name}: {len(leaked)} held-out prompts in a train file, e.g. "
                                   f"{sorted(leaked)[0]!r}")

    records["calibration.jsonl"] = [{"text": render_chat(r["messages"])}
                                    for r in records["sft_train.jsonl"][:config.calibration]]
    calibration_texts = {r["text"] for r in records["calibration.jsonl"]}
    records["text_heldout.jsonl"] = _heldout_text(config, calibration_texts)

    manifest = _write(out_dir, records, config, dropped)
    return manifest


def _heldout_text(config: DataConfig, exclude: set[str]) -> list[dict[str, str]]:
    """Plain text: facts about held-out problems mixed with simple sentences (never a train chat)."""
    rng = random.Random(f"text-heldout-{config.seed}")
    facts: list[str] = []
    for task in config.tasks:
        examples = generate_examples(task, "heldout", config.text_heldout, config.seed + 3)
        facts += [task_fact(ex) for ex in examples]
    rng.shuffle(facts)
    out = []
    for i in range(config.text_heldout):
        text = f"{facts[i % len(facts)]} {plain_sentence(rng)}" if facts else plain_sentence(rng)
        if text not in exclude:
            out.append({"text": text})
    return out


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def _write(out_dir: Path, records: dict[str, list[dict[str, Any]]], config: DataConfig,
           dropped: dict[str, int]) -> DataManifest:
    with staged_directory(out_dir, if_exists="replace") as tmp:
        for name in FILES:
            _write_jsonl(tmp / name, records[name])
        files = {name: sha256_file(tmp / name) for name in FILES}
        counts = {name: len(records[name]) for name in FILES}
        manifest = DataManifest(path=out_dir, config=asdict(config), counts=counts, files=files,
                                digest=digest_json(files), dropped_heldout_overlap=dropped)
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    return manifest


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Read one of this stage's files back (one JSON record a line)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
