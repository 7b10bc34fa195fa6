"""How much can GRPO gain on a model, and where does the model go wrong? A side-by-side of model dirs.

Why this exists: GRPO can only reinforce right answers the policy already samples, so its ceiling on
greedy accuracy is set by two things this script measures on the held-out task prompts:

* **pass@k vs greedy**: prompts the greedy reply gets wrong but some of k samples get right;
* **the first wrong token**: teacher-forcing the reference reply, the first position where the model's
  top token is not the reference's, and the probability the model gives the right token there. A model
  torn between two answers (p ~ 0.3-0.5) is one GRPO can sharpen; one at p ~ 1/10 on a digit is
  guessing, and a right sample there is luck that teaches nothing shared between prompts. The same is
  measured for every wrong *sampled* draw (where the draw left the reference): a slip at p(right) ~ 0.9
  is temperature noise that GRPO sharpens away, so sampled accuracy can rise while greedy stays put.

The first model is the baseline (usually GRPO's input, the DPO model); later ones are compared with it.
Run (after `make run`, with the dirs the pipeline printed):

    .venv/bin/python benchmarks/grpo_headroom.py --data RUN/data-KEY RUN/dpo-KEY/merged RUN/grpo-KEY/merged
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from evals.config import EvalConfig  # noqa: E402
from evals.context import EvalContext  # noqa: E402
from evals.data import TASKS_FILE  # noqa: E402
from evals.errors import EvalError  # noqa: E402
from evals.model import LoadedModel, load_model  # noqa: E402
from evals.scoring import is_correct  # noqa: E402
from evals.suites.preference import reply_item  # noqa: E402
from evals.suites.task_accuracy import task_records  # noqa: E402
from training.tasks import SUM_TASKS, addition_operands, addition_work, compose_reply  # noqa: E402

TORN = 0.3  # p(right token) at or above this: the model half-knows the step


@dataclass(frozen=True)
class FirstError:
    where: str  # "line L char C" of the reference reply, with the character the model should write
    p_right: float


@dataclass(frozen=True)
class Headroom:
    model: str
    n: int
    greedy: float
    sampled: float  # mean correctness over k draws at the temperature
    pass_at_k: float
    wrong_but_sampled_right: float  # share of all prompts: greedy wrong, at least one draw right
    errors: list[FirstError]  # greedy replies that are wrong: where the top token first leaves the reference
    slips: list[FirstError]  # sampled draws that are wrong: where the draw first leaves the reference


def median_p_right(errors: list[FirstError]) -> str:
    return f"{statistics.median(e.p_right for e in errors):.3f}" if errors else "-"


def torn_share(errors: list[FirstError]) -> str:
    return f"{sum(e.p_right >= TORN for e in errors) / len(errors):.2f}" if errors else "-"


def top_places(errors: list[FirstError], n: int = 3) -> str:
    counts = Counter(e.where for e in errors).most_common(n)
    return "; ".join(f"{where} x{count}" for where, count in counts) or "-"


def reference_reply(record: dict) -> str:
    """The reply the SFT data teaches: worked column lines for sums, the bare answer otherwise."""
    if record["task"] in SUM_TASKS:
        work, answer = addition_work(*addition_operands(record["prompt"]))
        return compose_reply(work, answer)
    return compose_reply("", record["answer"])


@dataclass(frozen=True)
class TeacherForced:
    """The reference reply's token ids and the model's distribution before each of them."""

    reply_ids: list[int]
    probs: torch.Tensor  # (len(reply_ids), vocab)


def teacher_force(lm: LoadedModel, record: dict) -> TeacherForced:
    """One forward pass over prompt + reference reply (the template's split, as the preference suite scores)."""
    prompt_ids, reply_ids = reply_item(lm, [{"role": "user", "content": record["prompt"]}],
                                       [{"role": "assistant", "content": reference_reply(record)}])
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([prompt_ids + reply_ids], device=lm.device)).logits[0].float()
    return TeacherForced(reply_ids, logits[len(prompt_ids) - 1:-1].softmax(-1))


def first_error(lm: LoadedModel, forced: TeacherForced, produced: list[int] | None = None) -> FirstError | None:
    """The first position where the model leaves the reference: where its top token is wrong (``produced``
    None) or where the ``produced`` reply (a sampled draw's ids) differs. None if it never leaves it."""
    for offset, target in enumerate(forced.reply_ids):
        dist = forced.probs[offset]
        if produced is None:
            chosen = int(dist.argmax())
        else:
            chosen = produced[offset] if offset < len(produced) else None
        if chosen != target:
            done = lm.tokenizer.decode(forced.reply_ids[:offset], skip_special_tokens=True)
            line, col = done.count("\n"), len(done) - (done.rfind("\n") + 1)
            char = lm.tokenizer.decode([target]).replace("\n", "\\n") or "eos"
            return FirstError(f"line {line} char {col} ({char!r})", float(dist[target]))
    return None


def model_label(model_dir: Path) -> str:
    """``dpo-d3a297dd26d2`` for a pipeline stage's ``.../dpo-d3a297dd26d2/stage``; the dir name otherwise."""
    return model_dir.parent.name if model_dir.name in ("stage", "bundle") else model_dir.name


def measure(model_dir: Path, data_dir: Path, k: int, temperature: float, max_new_tokens: int,
            batch_size: int) -> Headroom:
    limits = EvalConfig(max_new_tokens=max_new_tokens, batch_size=batch_size, samples_per_prompt=k,
                        sample_temperature=temperature)
    ctx = EvalContext(lm=load_model(model_dir), data_dir=data_dir, config=limits)
    records = task_records(ctx)
    prompts = [ctx.user_prompt(r["prompt"]) for r in records]
    greedy = [is_correct(g.text, r["answer"]) for g, r in zip(ctx.generate(prompts, desc="greedy"), records,
                                                              strict=True)]
    draws = ctx.sample(prompts, desc="sampled")  # the same seeded draws the sampled_task_accuracy suite scores
    sampled = [[is_correct(d.text, r["answer"]) for d in ds] for ds, r in zip(draws, records, strict=True)]
    errors: list[FirstError] = []
    slips: list[FirstError] = []
    for record, right, ds, hits in zip(records, greedy, draws, sampled, strict=True):
        if right and all(hits):
            continue
        forced = teacher_force(ctx.lm, record)  # once per record, shared by its greedy reply and its draws
        if not right and (e := first_error(ctx.lm, forced)) is not None:
            errors.append(e)
        slips += [e for d, hit in zip(ds, hits, strict=True) if not hit
                  if (e := first_error(ctx.lm, forced, ctx.lm.encode(d.text))) is not None]
    n = len(records)
    return Headroom(
        model=model_label(model_dir), n=n, greedy=sum(greedy) / n,
        sampled=sum(sum(s) / k for s in sampled) / n,
        pass_at_k=sum(any(s) for s in sampled) / n,
        wrong_but_sampled_right=sum(not g and any(s) for g, s in zip(greedy, sampled, strict=True)) / n,
        errors=errors, slips=slips,
    )


def table(rows: list[Headroom], k: int) -> str:
    """Two tables: accuracy and headroom, then where the wrong replies leave the reference and how sure the
    model was of the right token there (greedy errors, then sampled slips)."""
    base = rows[0]
    lines = [f"| model | greedy | sampled | pass@{k} | greedy wrong, a draw right |", "|---|---:|---:|---:|---:|"]
    for h in rows:
        delta = "" if h is base else f" ({(h.greedy - base.greedy) * 100:+.1f})"
        sampled_delta = "" if h is base else f" ({(h.sampled - base.sampled) * 100:+.1f})"
        lines.append(f"| {h.model} | {h.greedy:.3f}{delta} | {h.sampled:.3f}{sampled_delta} | {h.pass_at_k:.3f} | "
                     f"{h.wrong_but_sampled_right:.3f} |")
    lines += ["", f"| model | replies | wrong | median p(right) where it left | p >= {TORN} | where (top 3) |",
              "|---|---|---:|---:|---:|---|"]
    for h in rows:
        for kind, errors in (("greedy", h.errors), ("sampled", h.slips)):
            lines.append(f"| {h.model} | {kind} | {len(errors)} | {median_p_right(errors)} | {torn_share(errors)} | "
                         f"{top_places(errors)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path, help="HF model dirs; the first is the baseline")
    parser.add_argument("--data", type=Path, required=True, help=f"a data-stage dir with {TASKS_FILE}")
    parser.add_argument("--k", type=int, default=8, help="sampled replies per prompt (default 8)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    for path in [args.data, *args.models]:
        if not path.is_dir():
            print(f"error: {path}: not a directory", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    try:
        rows = [measure(m, args.data, args.k, args.temperature, args.max_new_tokens, args.batch_size)
                for m in args.models]
    except EvalError as exc:  # a data dir without the task file, a bad record, a dir that is not a model
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"\n{rows[0].n} held-out task prompts, {args.k} draws each at T {args.temperature}\n")
    print(table(rows, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
