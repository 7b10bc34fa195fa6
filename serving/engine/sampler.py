"""Vectorized token sampling over a batch of logits rows.

Work is done on whole [B, V] tensors; Python loops run only over rows that need something unusual
(penalties, a per-request seed). When every row is plain greedy the cost is one argmax.
Requests without a seed of their own draw from the sampler's generator, seeded from ``EngineConfig.seed``:
two engines with the same seed and the same request stream sample the same tokens, and torch's global
RNG is never touched (a training loop or another engine in the process cannot shift our draws).
Logprobs are those of the model's raw distribution (before temperature and penalties), as vLLM reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: {token_id: logprob} with the sampled token first, then the top-k; None if not asked
    logprobs: list[dict[int, float] | None]


def _blocked_ids(seq: Sequence) -> list[int]:
    """Token ids that may not be produced yet (EOS and stop ids before ``min_tokens``)."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
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


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set. k=0, p=1, min_p=0 mean off."""
    vocab = logits.shape[1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1).any())
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


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # one stream per device, seeded alike

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        want_lp = [s.params.logprobs for s in seqs]
        raw_logprobs = logits.log_softmax(-1) if any(k is not None for k in want_lp) else None

        blocked = [_blocked_ids(s) for s in seqs]
        if any(s.params.has_penalties for s in seqs) or any(blocked):
            logits = logits.clone()
            apply_penalties(logits, seqs)
            for i, ids in enumerate(blocked):
                if ids:
                    idx = torch.tensor([t for t in ids if t < logits.shape[1]], dtype=torch.long,
                                       device=logits.device)
                    logits[i, idx] = float("-inf")

        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits, seqs, greedy)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw_logprobs, token_list, want_lp))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        greedy_t = torch.tensor(greedy, device=dev)
        argmax = logits.argmax(-1)
        temp = torch.tensor([1.0 if g else s.params.temperature for s, g in zip(seqs, greedy)],
                            device=dev, dtype=logits.dtype)
        scaled = logits / temp[:, None]
        top_k = torch.tensor([s.params.top_k for s in seqs], device=dev)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=dev, dtype=logits.dtype)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=dev, dtype=logits.dtype)
        scaled = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
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
        return torch.where(greedy_t, argmax, sampled)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int],
                  want: list[int | None]) -> list[dict[int, float] | None]:
        if raw is None:
            return [None] * len(tokens)
        kmax = max(k for k in want if k is not None)
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
        top_vals, top_ids = (raw.topk(kmax, dim=-1) if kmax > 0 else (None, None))
        tv = top_vals.tolist() if top_vals is not None else None
        ti = top_ids.tolist() if top_ids is not None else None
        out: list[dict[int, float] | None] = []
        for i, k in enumerate(want):
            if k is None:
                out.append(None)
                continue
            rec = {tokens[i]: chosen[i]}
            for j in range(k):
                rec.setdefault(ti[i][j], tv[i][j])
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
