"""Vectorized token sampling over a batch of logits rows.

Work is done on whole [B, V] tensors; Python loops run only over rows that need something unusual
(penalties, a per-request seed). When every row is plain greedy the cost is one argmax.
Requests without a seed of their own draw from the sampler's generator, seeded from ``EngineConfig.seed``:
two engines with the same seed and the same request stream sample the same tokens, and torch's global
RNG is never touched (a training loop or another engine in the process cannot shift our draws).
Logprobs are those of the model's raw distribution (before temperature and penalties), as vLLM reports.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from serving.engine.host_transfer import HostReadback, PendingReadback, PinnedStaging
from serving.engine.sequence import Sequence
from serving.engine.structured_output import fill_masks


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: {token_id: logprob} with the sampled token first, then the top-k; None if not asked
    logprobs: list[dict[int, float] | None]
    extra: list[list] = field(default_factory=list)  # the ``extra`` tensors of the call, as lists


def _blocked_ids(seq: Sequence) -> list[int]:
    """Token ids that may not be produced yet (EOS and stop ids before ``min_tokens``). A constrained reply's
    grammar alone decides where it ends: blocking its end could leave it no token at all."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens or seq.grammar is not None:
        return []
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids |= set(seq.eos_token_ids)
    return sorted(ids)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: repetition (prompt+output, HF style), presence and frequency (output only, OpenAI style)."""
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        row = logits[i]
        out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                            need: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set. k=0, p=1, min_p=0 mean off.

    ``need`` (top-k, top-p, min-p: whether any row uses each) comes from the host-side parameters; without it
    the tensors are inspected, which on a GPU waits for them (three syncs the engine's sampler avoids)."""
    vocab = logits.shape[1]
    if need is None:
        need = (bool((top_k > 0).any()), bool((top_p < 1).any()), bool((min_p > 0).any()))
    need_k, need_p, need_min_p = need
    if need_min_p:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        drop |= rank >= k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop |= (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list,
                        filling: Future[torch.Tensor] | None = None) -> None:
    """In place: -inf for every token the row's grammar does not allow next. The masks are filled on the host
    (the parser state lives there) and sent in one copy; only the constrained rows are touched. ``filling``: the
    same masks, begun before the forward (``structured_output.start_fill``)."""
    allowed = filling.result() if filling is not None else fill_masks(matchers, logits.shape[1])
    if logits.device.type != "cpu":
        allowed = allowed.pin_memory().to(logits.device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class PendingSample:
    """A batch's sampled ids on the device, on their way to the host: ``token_ids`` is the device tensor (one id per
    row, int64), ``result()`` waits for the copy and gives the ``SampleResult``."""

    def __init__(self, token_ids: torch.Tensor, readback: PendingReadback, n_extra: int,
                 want_logprobs: list[int | None]) -> None:
        self.token_ids = token_ids
        self._readback = readback
        self._n_extra = n_extra
        self._want = want_logprobs

    def result(self) -> SampleResult:
        values = self._readback.wait()
        token_list, rest = values[0], values[1:1 + self._n_extra]
        if not any(k is not None for k in self._want):
            return SampleResult(token_list, [None] * len(self._want), rest)
        chosen, *tops = values[1 + self._n_extra:]
        tv, ti = tops if tops else (None, None)
        return SampleResult(token_list, _logprob_records(token_list, chosen, tv, ti, self._want), rest)


class Sampler:
    """Samples one token per row. Every choice that depends on the requests' parameters is made on the host from
    ``SamplingParams``; the per-row parameters and the ids to block go to the device in one non-blocking copy
    (``host_transfer.PinnedStaging``), and the results come back through ``HostReadback``: one wait per call, for
    the sampled ids (and logprobs when asked), never a sync in between."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # one stream per device, seeded alike
        self._staging: dict[torch.device, PinnedStaging] = {}
        self._readback: dict[torch.device, HostReadback] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def readback(self, device: torch.device) -> HostReadback:
        rb = self._readback.get(device)
        if rb is None:
            rb = self._readback[device] = HostReadback(device)
        return rb

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 extra: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
                 grammar_masks: Future[torch.Tensor] | None = None) -> SampleResult:
        """One token per row of ``logits`` for ``seqs``, waited for (``launch`` then ``result``)."""
        return self.launch(logits, seqs, extra, grammar_masks).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence],
               extra: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
               grammar_masks: Future[torch.Tensor] | None = None) -> PendingSample:
        """Sample one token per row of ``logits`` for ``seqs`` without waiting: the ids stay on the device
        (``PendingSample.token_ids``, what the next step's inputs can read) and come back with ``result()``.
        ``extra`` device tensors (the step's other results) come back in the same wait. ``grammar_masks``: the
        constrained rows' masks, in the order of ``seqs``, being filled since before the forward."""
        dev = logits.device
        want_lp = [s.params.logprobs for s in seqs]
        raw_logprobs = logits.log_softmax(-1) if any(k is not None for k in want_lp) else None
        greedy = [s.params.greedy for s in seqs]
        blocked = [(i, t) for i, s in enumerate(seqs) for t in _blocked_ids(s) if t < logits.shape[1]]
        sampled = not all(greedy)
        params = self._upload(dev, seqs, greedy, blocked, sampled) if sampled or blocked else {}
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if any(s.params.has_penalties for s in seqs) or blocked or constrained:
            logits = logits.clone()
            apply_penalties(logits, seqs)
            if blocked:
                logits[params["blocked_rows"], params["blocked_ids"]] = float("-inf")
            if constrained:
                apply_grammar_masks(logits, constrained, [seqs[i].grammar for i in constrained], grammar_masks)
        tokens = self._sample(logits, seqs, greedy, params) if sampled else logits.argmax(-1)
        if raw_logprobs is None:
            return PendingSample(tokens, self.readback(dev).start(tokens, *extra), len(extra), want_lp)
        kmax = max(k for k in want_lp if k is not None)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        if kmax > 0:
            top_vals, top_ids = raw_logprobs.topk(kmax, dim=-1)
            pending = self.readback(dev).start(tokens, *extra, chosen, top_vals, top_ids)
        else:
            pending = self.readback(dev).start(tokens, *extra, chosen)
        return PendingSample(tokens, pending, len(extra), want_lp)

    def _upload(self, dev: torch.device, seqs: list[Sequence], greedy: list[bool], blocked: list[tuple[int, int]],
                sampled: bool) -> dict[str, torch.Tensor]:
        """The per-row parameters the device needs, written on the host and sent in one copy."""
        staging = self._staging.get(dev)
        if staging is None:
            staging = self._staging[dev] = PinnedStaging(dev)
        n = len(seqs) if sampled else 0
        sizes = {"greedy": n, "temperature": n, "top_k": n, "top_p": n, "min_p": n,
                 "blocked_rows": len(blocked), "blocked_ids": len(blocked)}
        staging.reserve(sum(sizes.values()))
        buf, floats = staging.array, staging.array.view(np.float32)
        offsets, o = {}, 0
        for name, size in sizes.items():
            offsets[name] = (o, o + size)
            o += size
        if sampled:
            a, b = offsets["greedy"]
            buf[a:b] = greedy
            a, b = offsets["temperature"]
            floats[a:b] = [1.0 if g else s.params.temperature for s, g in zip(seqs, greedy)]
            a, b = offsets["top_k"]
            buf[a:b] = [s.params.top_k for s in seqs]
            a, b = offsets["top_p"]
            floats[a:b] = [s.params.top_p for s in seqs]
            a, b = offsets["min_p"]
            floats[a:b] = [s.params.min_p for s in seqs]
        if blocked:
            a, b = offsets["blocked_rows"]
            buf[a:b] = [r for r, _ in blocked]
            a, b = offsets["blocked_ids"]
            buf[a:b] = [t for _, t in blocked]
        staging.upload(o)
        views = {}
        for name, (a, b) in offsets.items():
            t = staging.dev[a:b]
            if name in ("temperature", "top_p", "min_p"):
                t = t.view(torch.float32)
            elif name in ("blocked_rows", "blocked_ids"):
                t = t.long()
            views[name] = t
        return views

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool],
                params: dict[str, torch.Tensor]) -> torch.Tensor:
        dev = logits.device
        argmax = logits.argmax(-1)
        scaled = logits / params["temperature"].to(logits.dtype)[:, None]
        need = (any(s.params.top_k > 0 for s in seqs), any(s.params.top_p < 1 for s in seqs),
                any(s.params.min_p > 0 for s in seqs))
        scaled = apply_top_k_top_p_min_p(scaled, params["top_k"], params["top_p"].to(logits.dtype),
                                         params["min_p"].to(logits.dtype), need)
        probs = scaled.softmax(-1)
        # Gumbel-style sampling: argmax(p / E) with E ~ Exp(1) draws from p; per-row noise lets seeded
        # rows use their own generator, so a seeded request is reproducible whatever its batch.
        noise = torch.empty_like(probs).exponential_(generator=self._generator(dev))
        for i, s in enumerate(seqs):
            if s.params.seed is not None and not greedy[i]:
                if s.generator is None:
                    s.generator = torch.Generator(device=dev).manual_seed(s.params.seed)
                noise[i] = torch.empty(probs.shape[1], device=dev).exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(-1)
        return torch.where(params["greedy"].bool(), argmax, sampled)


def _logprob_records(tokens: list[int], chosen: list[float], top_vals: list[list[float]] | None,
                     top_ids: list[list[int]] | None, want: list[int | None]) -> list[dict[int, float] | None]:
    out: list[dict[int, float] | None] = []
    for i, k in enumerate(want):
        if k is None:
            out.append(None)
            continue
        rec = {tokens[i]: chosen[i]}
        for j in range(k):
            rec.setdefault(top_ids[i][j], top_vals[i][j])
        out.append(rec)
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[dict[int, float]]:
    """Records for prompt positions: row r scores ``next_tokens[r]`` plus the top-k alternatives."""
    lp = logits.log_softmax(-1)
    idx = torch.tensor(next_tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    recs: list[dict[int, float]] = [{t: c} for t, c in zip(next_tokens, chosen)]
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)
        for rec, vs, ix in zip(recs, vals.tolist(), ids.tolist()):
            for t, v in zip(ix, vs):
                rec.setdefault(t, v)
    return recs
