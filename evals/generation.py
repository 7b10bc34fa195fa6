"""Batched generation for the generation-based suites: greedy, or seeded sampling.

Why left padding: a decoder-only model continues from the last position of each row, so every prompt
must end at the same column. Prompts are sorted by length before batching (less padding, less
compute) and results are returned in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from evals.constrained import SchemaMasks
from evals.engine_generation import engine_generator
from evals.errors import EvalError
from evals.model import LoadedModel


@dataclass
class Generation:
    """One greedy reply. ``text`` drops special tokens (for answer parsing); ``raw`` keeps any the model
    emitted before stopping, counted in ``n_special`` (a reply with a stray ``<|user|>`` is off-format);
    neither includes the stop token, which ``n_tokens`` does count."""

    text: str
    raw: str
    stopped_on_eos: bool
    n_tokens: int
    n_special: int = 0


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i:i + size] for i in range(0, len(order), size)]


def _generation_config(lm: LoadedModel, max_new_tokens: int, temperature: float):
    """A fresh config: a model's own sampling defaults (temperature, top_p, top_k) must not leak in.

    ``temperature`` 0 is greedy; above 0 it samples from the whole distribution (no top-p, no top-k),
    as our server does for a request that names only a temperature."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {
        "do_sample": False}
    return GenerationConfig(max_new_tokens=max_new_tokens, num_beams=1, eos_token_id=list(lm.eos_ids),
                            pad_token_id=lm.pad_id, **sampling)


def generate_replies(lm: LoadedModel, prompts: list[str], max_new_tokens: int, batch_size: int,
                     desc: str = "generate", temperature: float = 0.0, seed: int = 0,
                     schemas: list[dict[str, Any]] | None = None) -> list[Generation]:
    """Replies to already-templated ``prompts``, stopping at any of the model's eos ids.

    Greedy by default. With ``temperature`` > 0 the replies are sampled, seeded by ``seed``: the same prompts
    give the same replies on every run on the same device, which is what lets two models' sampled scores be
    compared. The serving engine writes them where ``lm.generation_backend`` lets it (evals.engine_generation:
    each reply from its own seeded generator); otherwise ``transformers`` does, from one generator seeded
    with ``seed`` (forked, so the caller's random state is untouched).
    With ``schemas`` (one JSON schema per prompt) each reply is constrained to its schema (``evals.constrained``)."""
    if schemas is not None and len(schemas) != len(prompts):
        raise EvalError(f"{len(schemas)} schemas for {len(prompts)} prompts")
    if temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {temperature}")
    budget = lm.max_context - max_new_tokens
    if budget < 1:
        raise EvalError(f"{lm.model_dir}: max_new_tokens={max_new_tokens} leaves no room for a prompt "
                        f"in a context of {lm.max_context} tokens")
    encoded = [lm.encode(p)[-budget:] for p in prompts]  # keep the end: it holds the generation prompt
    engine = engine_generator(lm, batch_size) if schemas is None else None
    if engine is not None:
        with tqdm(total=len(prompts), desc=desc, unit="reply") as bar:
            replies = engine.replies(encoded, max_new_tokens, temperature, seed, on_finished=lambda _: bar.update())
        special = set(lm.tokenizer.all_special_ids)
        return [_generation(lm, r.token_ids, r.stopped_on_eos, special) for r in replies]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]), reverse=True)
    config = _generation_config(lm, max_new_tokens, temperature)
    out: list[Generation | None] = [None] * len(prompts)
    cuda = [lm.device] if lm.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        _generate_batches(lm, encoded, order, config, batch_size, desc, out, schemas)
    return [g for g in out if g is not None]


def _generate_batches(lm: LoadedModel, encoded: list[list[int]], order: list[int], config, batch_size: int,
                      desc: str, out: list[Generation | None], schemas: list[dict[str, Any]] | None) -> None:
    eos = set(lm.eos_ids)
    special = set(lm.tokenizer.all_special_ids)
    for batch in tqdm(_batches(order, batch_size), desc=desc, unit="batch"):
        width = max(len(encoded[i]) for i in batch)
        ids = torch.full((len(batch), width), lm.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(encoded[i])
            ids[row, width - n:] = torch.tensor(encoded[i], dtype=torch.long)
            mask[row, width - n:] = 1
        constrained = {}
        if schemas is not None:
            from transformers import LogitsProcessorList

            masks = SchemaMasks(lm.tokenizer, lm.model.config.vocab_size, lm.eos_ids, [schemas[i] for i in batch])
            constrained = {"logits_processor": LogitsProcessorList([masks])}
        with torch.inference_mode():
            generated = lm.model.generate(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
                                          generation_config=config, **constrained)
        for row, i in enumerate(batch):
            tokens = generated[row, width:].tolist()
            stop = next((k for k, t in enumerate(tokens) if t in eos), None)
            out[i] = _generation(lm, tokens if stop is None else tokens[:stop], stop is not None, special)


def _generation(lm: LoadedModel, reply: list[int], stopped: bool, special: set[int] | None = None) -> Generation:
    """A reply's record from its token ids (the stop token left out)."""
    special = set(lm.tokenizer.all_special_ids) if special is None else special
    return Generation(text=lm.tokenizer.decode(reply, skip_special_tokens=True),
                      raw=lm.tokenizer.decode(reply, skip_special_tokens=False), stopped_on_eos=stopped,
                      n_tokens=len(reply) + stopped, n_special=sum(t in special for t in reply))
