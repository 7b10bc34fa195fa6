"""The synthetic pretraining corpus of the embedded base model.

Why it contains chat text: LoRA adapters cannot teach embeddings of special tokens the base model never
saw (the embedding rows are not adapted), so the corpus already holds task conversations rendered with the
real chat template: ``Answer: X`` replies, refusals for the harmful safety category and helpful replies for
look-alikes. Plain sentences (task facts and simple English) give perplexity and quantization checks ordinary text too.
Only the *train* split of every task and of the safety set goes in; held-out problems never do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from training.tasks import SUM_TASKS, TaskExample, addition_operands, generate_examples, generate_safety, safety_reply
from training.tokenizer import BOS, EOS, render_chat

SYSTEM_PROMPT = "You are a helpful assistant."

_SUBJECTS = ("the cat", "a small dog", "my friend", "the teacher", "a farmer", "the old man", "the child",
             "a young girl", "the baker", "our neighbor", "the pilot", "a student")
_VERBS = ("sees", "likes", "finds", "paints", "carries", "cleans", "opens", "builds", "reads", "buys")
_OBJECTS = ("a red ball", "the green door", "a big box", "the blue car", "a new book", "the wooden chair",
            "a warm coat", "the little boat", "an old map", "a paper kite", "the bright lamp")
_PLACES = ("in the park", "at home", "near the river", "in the morning", "after lunch", "by the sea",
           "in the garden", "at school", "on the hill", "before dinner")


@dataclass(frozen=True)
class CorpusSpec:
    """How many documents of each kind; part of the base-model recipe (and so of its digest)."""

    tasks: tuple[str, ...] = ("addition", "reverse")
    chats_per_task: int = 300
    facts_per_task: int = 100
    first_task_repeats: int = 1  # the first task (the one GRPO trains) gets a larger share of the stream
    safety_repeats: int = 2
    plain_sentences: int = 200
    system_prompt_share: float = 0.1
    seed: int = 0


def plain_sentence(rng: random.Random) -> str:
    """A short simple English sentence from templates (plain text, no chat markup)."""
    sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
    return sentence[0].upper() + sentence[1:]


def task_fact(example: TaskExample) -> str:
    """The same problem as a plain-text statement, e.g. ``37 + 48 = 85.``."""
    if example.task in SUM_TASKS:
        a, b = addition_operands(example.prompt)
        return f"{a} + {b} = {example.answer}."
    if example.task == "reverse":
        word = example.prompt.rsplit(" ", 1)[-1]
        return f"The word {word} reversed is {example.answer}."
    return f"{example.prompt} {example.answer}"


def _chat(rng: random.Random, user: str, assistant: str, system_share: float) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    if rng.random() < system_share:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return render_chat(messages) + EOS


def build_corpus(spec: CorpusSpec) -> list[str]:
    """The documents, shuffled; each starts with ``<s>`` and ends with ``</s>``."""
    rng = random.Random(spec.seed)
    docs: list[str] = []
    for index, task in enumerate(spec.tasks):
        chats = generate_examples(task, "train", spec.chats_per_task, seed=spec.seed)
        for _ in range(spec.first_task_repeats if index == 0 else 1):
            docs += [_chat(rng, ex.prompt, ex.reply, spec.system_prompt_share) for ex in chats]
        for ex in generate_examples(task, "train", spec.facts_per_task, seed=spec.seed + 1):
            docs.append(f"{BOS}{task_fact(ex)}{EOS}")
    for _ in range(spec.safety_repeats):
        for ex in generate_safety("train", 10_000, seed=spec.seed):
            docs.append(_chat(rng, ex.prompt, safety_reply(ex), spec.system_prompt_share))
    for _ in range(spec.plain_sentences):
        docs.append(f"{BOS}{plain_sentence(rng)} {plain_sentence(rng)}{EOS}")
    rng.shuffle(docs)
    return docs
