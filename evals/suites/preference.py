"""preference_accuracy: how often the model gives the chosen reply a higher summed log-prob than the
rejected one, both conditioned on the chat-templated prompt (the implicit reward DPO trains)."""

from __future__ import annotations

from evals.context import EvalContext
from evals.data import PREF_FILE, messages_problem
from evals.errors import EvalError
from evals.logprobs import Item, completion_logprobs
from evals.model import LoadedModel
from evals.results import EvalResult
from evals.suites.base import Suite
from evals.suites.common import mean_result, slice_labels, stratum

PREF_FIELDS: dict[str, type | tuple[type, ...]] = {"prompt": list, "chosen": list, "rejected": list}


def reply_item(lm: LoadedModel, prompt: list[dict[str, str]], reply: list[dict[str, str]]) -> Item:
    """Token ids of the templated prompt and of the reply turn(s) the template appends to it.

    The reply is the rendered conversation minus the rendered prompt, so it includes the template's
    end-of-turn tokens: a model that does not know when to stop is scored for it. If a template does
    not render the prompt as a prefix of the conversation, the reply text plus eos is scored instead.
    """
    prompt_text = lm.chat_prompt(prompt)
    full_text = lm.chat_text(prompt + reply)
    if full_text.startswith(prompt_text) and len(full_text) > len(prompt_text):
        reply_text = full_text[len(prompt_text):]
    else:
        reply_text = "".join(m["content"] for m in reply) + (lm.tokenizer.eos_token or "")
    prompt_ids, reply_ids = lm.encode(prompt_text), lm.encode(reply_text)
    if not reply_ids:
        raise EvalError(f"{lm.model_dir}: a preference reply encodes to no tokens")
    reply_ids = reply_ids[: lm.max_context - 1]
    keep = lm.max_context - len(reply_ids)
    return (prompt_ids[-keep:] if prompt_ids else [lm.pad_id]), reply_ids


def run(ctx: EvalContext) -> list[EvalResult]:
    records = ctx.records(PREF_FILE, PREF_FIELDS, stratify=lambda r: stratum(r, "task", "kind"),
                          check=lambda r: messages_problem(r, "prompt", "chosen", "rejected"))
    items: list[Item] = []
    for record in records:
        for side in ("chosen", "rejected"):
            items.append(reply_item(ctx.lm, record["prompt"], record[side]))
    logprobs = completion_logprobs(ctx.lm, items, ctx.config.batch_size, desc="preference")
    scores = [float(logprobs[2 * i] > logprobs[2 * i + 1]) for i in range(len(records))]
    labels = slice_labels([stratum(r, "task", "kind") for r in records])
    return [mean_result("preference_accuracy", "preference_accuracy", scores, labels)]


SUITE = Suite("preference_accuracy", (PREF_FILE,), run,
              "fraction of held-out preference pairs where log p(chosen) > log p(rejected)")
