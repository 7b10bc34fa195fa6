"""Greedy or sampled generation under a JSON schema, for the ``structured`` suite: a logits processor for
Hugging Face ``generate`` that masks, row by row, every token the row's schema does not allow.

The grammar library is llguidance, as in the server (``serving.engine.structured_output``, which says why);
the eval compiles with the server's options (no free whitespace), so "the model's accuracy when constrained" is
measured under the grammar users get. Kept apart from the server's code because the evals sit below serving.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from evals.errors import EvalError


@functools.lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


def _matcher(ll_tokenizer: Any, schema: str) -> Any:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        raise EvalError(f"schema {schema}: {exc}") from None
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise EvalError(f"schema {schema}: {matcher.get_error()}")
    return matcher


class SchemaMasks:
    """One llguidance matcher per row of a ``generate`` batch; called by ``generate`` before each token.

    A row that has emitted an eos is done (Hugging Face pads it from then on, and those pads are not fed to its
    matcher). A row whose matcher has seen a complete reply may only end; every other row may write what its
    schema allows next."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], schemas: list[dict[str, Any]]) -> None:
        ll_tokenizer = _grammar_tokenizer(tokenizer, vocab_size, tuple(eos_ids))
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.matchers = [_matcher(ll_tokenizer, json.dumps(s, separators=(",", ":"))) for s in schemas]
        self.done = [False] * len(schemas)
        self._started = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._started:
            self._advance(input_ids[:, -1].tolist())
        self._started = True
        allowed = torch.zeros(scores.shape, dtype=torch.bool)
        open_rows = [(row, m) for row, m in enumerate(self.matchers) if not self.done[row] and not m.is_stopped()]
        if open_rows:
            allowed[[row for row, _ in open_rows], :self.vocab_size] = self._masks([m for _, m in open_rows])
        for row, m in enumerate(self.matchers):
            if self.done[row]:
                allowed[row] = True  # a finished row's token is a pad whatever it scores
            elif m.is_stopped():
                allowed[row, self.eos_ids] = True
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def _advance(self, tokens: list[int]) -> None:
        for row, token in enumerate(tokens):
            if self.done[row]:
                continue
            if token in self.eos_ids:
                self.done[row] = True
            elif not self.matchers[row].is_stopped() and not self.matchers[row].consume_token(token):
                raise EvalError(f"token {token} breaks the schema of row {row}: {self.matchers[row].get_error()}")

    def _masks(self, matchers: list[Any]) -> torch.Tensor:
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
        words = bitmask.to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, :, None] >> torch.arange(32)) & 1
        return bits.reshape(len(matchers), -1)[:, :self.vocab_size].bool()
