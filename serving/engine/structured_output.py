"""Constrained decoding: a request's ``response_format`` as a grammar that masks every token it does not allow.

The grammar library is llguidance, chosen by measurement on our own tokenizers (benchmarks/RESULTS.md,
"Grammar libraries"): over the same random schemas, every reply a random walk through its masks could write was
valid JSON for its schema, where xgrammar (5x faster per mask) let raw control characters into strings on the
embedded tokenizer and 12 of 50 replies did not parse. A mask that admits an invalid reply breaks the one promise
``response_format`` makes; ~15-35 µs per constrained row per step is a price the host pays beside the forward.

Each request gets its own matcher (the parser state), copied from a pristine one compiled once per schema and
kept in an LRU (``GrammarCache``): a copy costs ~1.5 µs, a compile ~1-2 ms. The sampler asks each constrained row's
matcher for its mask (``fill_masks``); the stop rules feed it every token appended (``advance``), and a
matcher that has seen a complete reply ends the request with ``finish_reason: stop``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from serving.engine.errors import InvalidRequestError

if TYPE_CHECKING:  # torch loads where masks are filled (the engine), not in the API process that compiles
    import torch

GRAMMAR_CACHE_SIZE = 256
# OpenAI's json_object mode: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutput:
    """What a reply must be: ``json_object`` (any object), ``json_schema`` (this schema, as compact JSON text,
    which is also the cache key) or ``lark`` (a grammar in llguidance's Lark dialect, JSON parts as ``%json``:
    a chat template's own tool-call format, text around JSON). ``where`` names the request field for errors."""

    kind: Literal["json_object", "json_schema", "lark"]
    schema: str = JSON_OBJECT_SCHEMA
    where: str = "response_format"
    # the last ``prefix_tokens`` prompt tokens are the reply so far (a gateway finishing a stream on another
    # replica): the grammar reads them before the first new token
    prefix_tokens: int = 0
    # a Lark grammar's JSON parts, as (request path, schema JSON): where an error about a keyword points
    json_parts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json_schema(cls, schema: dict, where: str = "response_format.json_schema.schema") -> StructuredOutput:
        # keys in the client's order: a reply writes an object's properties in the order its schema lists them
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), where)

    @classmethod
    def lark(cls, grammar: str, where: str, json_parts: tuple[tuple[str, str], ...] = ()) -> StructuredOutput:
        return cls("lark", grammar, where, json_parts=json_parts)


class GrammarCache:
    """Compiles schemas into llguidance matchers for one tokenizer, once per schema (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        # every id that ends a reply may end a constrained one: the model's chat end token as well as </s>
        eos = sorted(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._pristine: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # API threads add requests (and compile) beside each other
        self.compiles = 0

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for ``spec``; InvalidRequestError (a 400) naming the part of the schema it cannot use."""
        with self._lock:
            pristine = self._pristine.get(spec.schema)
            if pristine is not None:
                self._pristine.move_to_end(spec.schema)
                return pristine.deep_copy()
        pristine = self._compile(spec)  # outside the lock: another schema's request need not wait for this one
        with self._lock:
            self._pristine[spec.schema] = pristine
            while len(self._pristine) > self.capacity:
                self._pristine.popitem(last=False)
            return pristine.deep_copy()

    def _compile(self, spec: StructuredOutput) -> Any:
        ll = self._ll
        try:
            grammar = spec.schema if spec.kind == "lark" else ll.LLMatcher.grammar_from_json_schema(
                spec.schema, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise InvalidRequestError(f"{spec.where}: {_first_line(exc)}") from exc
        matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{_locate(spec, matcher.get_error())}: {_first_line(matcher.get_error())}")
        self.compiles += 1
        return matcher


def _first_line(error: object) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "cannot be compiled"


def _locate(spec: StructuredOutput, error: str) -> str:
    """The request path of the schema part an llguidance error is about, where the error names a keyword
    (``Unimplemented keys: ["not"]``): the first place that keyword appears, else the schema itself."""
    if "keys:" not in error:
        return spec.where
    # a Lark grammar names its JSON parts; else its JSON part is the schema after its last `%json`
    parts = spec.json_parts or ((spec.where, spec.schema.rsplit("%json", 1)[-1] if spec.kind == "lark"
                                 else spec.schema),)
    try:
        keys = set(json.loads(error.split("keys:", 1)[1].strip().splitlines()[0]))
    except (ValueError, IndexError):
        return spec.where
    for where, text in parts:
        try:
            path = _find_key(json.loads(text), keys)
        except ValueError:
            continue
        if path is not None:
            return where + "".join(f".{p}" for p in path)
    return spec.where


def _find_key(node: Any, keys: set[str], path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys:
                return (*path, key)
            found = _find_key(value, keys, (*path, key))
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _find_key(value, keys, (*path, str(i)))
            if found is not None:
                return found
    return None


def start_matcher(cache: GrammarCache, spec: StructuredOutput, prompt_token_ids: list[int]) -> Any:
    """The request's matcher, past the reply so far when the prompt ends with one (``prefix_tokens``)."""
    if spec.prefix_tokens > len(prompt_token_ids):
        raise InvalidRequestError(f"response_prefix_tokens: {spec.prefix_tokens} is more than the prompt's "
                                  f"{len(prompt_token_ids)} tokens")
    matcher = cache.matcher(spec)
    for token in prompt_token_ids[len(prompt_token_ids) - spec.prefix_tokens:]:
        if not matcher.consume_token(token):
            raise InvalidRequestError("response_prefix_tokens: the reply so far does not fit response_format "
                                      f"({_first_line(matcher.get_error())})")
    return matcher


def fill_masks(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """One row of allowed tokens per matcher, as a bool tensor [rows, vocab_size] on the host.

    The rows are filled by llguidance's own thread pool, outside the GIL: 64 rows of the bench model's vocabulary
    took 0.96 ms against 2.0 ms one after another on 2 busy cores (2026-11-28)."""
    import llguidance.torch
    import torch

    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    llguidance.torch.fill_next_token_bitmask_par(_executor(), [(m, row) for row, m in enumerate(matchers)], bitmask)
    # unpacked here, not by llguidance.torch.apply_token_bitmask_inplace: that one is torch.compile'd, seconds of
    # compiling (and a C++ compiler) on a replica's first constrained request
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] >> torch.arange(32)) & 1
    return bits.reshape(len(matchers), -1)[:, :vocab_size].bool()


def start_fill(matchers: list[Any], vocab_size: int) -> Future[torch.Tensor]:
    """``fill_masks`` on a thread of its own, begun before the step's forward and waited for by the sampler.

    The parser state a mask depends on is final once the previous step's tokens were fed (the scheduler commits
    them before it plans this step), so the masks can be filled while the model computes the logits they will
    mask: the fill leaves the step's critical path. Nothing advances a matcher before the sampler has waited."""
    return _fill_thread().submit(fill_masks, matchers, vocab_size)


@functools.cache
def _fill_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor()


def advance(matcher: Any, token: int) -> bool:
    """Feed ``token`` to the matcher; True when the reply is complete (nothing but its end may follow).

    A token the matcher refuses cannot come from a masked step; it would come from a path that skipped the mask
    (a bug), so it is an error for this request, not a silent break of the schema."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"structured output: token {token} breaks the grammar ({matcher.get_error()})")
    return matcher.is_stopped()
