"""`/v1/completions` (vLLM's ``serving_completion``): prompts as text or token ids, ``n`` choices, ``echo``
with prompt ``logprobs`` (lm-evaluation-harness scores with it), SSE streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from serving.api.errors import APIError
from serving.api.generation import Generation, SubRequest
from serving.api.openai_serving import OpenAIServing, finite
from serving.api.protocol import CompletionRequest
from serving.api.sampling_factory import SamplingFactory
from serving.api.sse import TokenIdsOut
from serving.engine import RequestOutput


class CompletionServing(OpenAIServing):
    async def create(self, request: Request) -> Any:
        req: CompletionRequest = await self.read(request, CompletionRequest)
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        prompts, texts = self._prompts(req.prompt)
        if req.echo and req.stream:
            raise APIError(400, "echo: not supported together with stream", param="echo")
        lp = req.logprobs
        make = SamplingFactory(req, self.state.engine.sampling_defaults, req.max_tokens, lp,
                               lp if (req.echo and lp is not None) else None)
        gen = self.start(request, "cmpl", prompts, make, req.model)
        if req.stream:
            return self.respond(request, self._stream(req, gen))
        return self.respond(request, await self._full(request, req, gen, texts))

    def _prompts(self, p: Any) -> tuple[list[list[int]], list[str | None]]:
        """Token ids of each prompt, and the client's own text of each (None for token-id prompts)."""
        engine = self.state.engine
        if isinstance(p, str):
            return [engine.encode(p)], [p]
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            return [list(p)], [None]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [engine.encode(x) for x in p], list(p)
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            return [list(x) for x in p], [None] * len(p)
        raise APIError(400, "prompt: must be a non-empty string, list of strings, or token id list(s)",
                       param="prompt")

    def _added_tokens(self, text: str | None, ids: list[int]) -> int:
        """How many leading ids the tokenizer added to the client's text (Llama's <s>): they are listed and
        scored, but take no room in the echoed text."""
        if text is None or self.tok is None:
            return 0
        plain = self.tok.encode(text, add_special_tokens=False)
        k = len(ids) - len(plain)
        return k if k > 0 and ids[k:] == plain else 0

    def _logprobs(self, token_ids: list[int], recs: list[dict[int, float] | None],
                  zero_width: int = 0) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        for i, (tid, rec) in enumerate(zip(token_ids, recs)):
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(off)
            if i >= zero_width:
                off += len(s)
            if rec is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(finite(rec.get(tid)))
                top: dict[str, float] = {}
                for t, v in rec.items():
                    top.setdefault(self.token_str(t), finite(v))
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _full(self, request: Request, req: CompletionRequest, gen: Generation,
                    texts: list[str | None]) -> dict[str, Any]:
        outs = await self.gather(gen, request)
        choices = []
        for sub, o in zip(gen.subs, outs):
            text, logprobs = o.text, None
            if req.echo:
                # the prompt as the client sent it: a decode of its ids would show the <s> the tokenizer added
                given = texts[sub.prompt_index]
                if given is None:  # token ids: the client sent every one of them, specials included
                    given = self.tok.decode(gen.prompts[sub.prompt_index],
                                            clean_up_tokenization_spaces=False) if self.tok else ""
                text = given + text
            if req.logprobs is not None:
                ids, recs, zero_width = [], [], 0
                if req.echo:
                    ids += o.prompt_token_ids
                    recs += (o.prompt_logprobs or [None] * len(ids))
                    zero_width = self._added_tokens(texts[sub.prompt_index], o.prompt_token_ids)
                ids += o.token_ids
                recs += (o.outputs[0].logprobs or [None] * len(o.token_ids))
                logprobs = self._logprobs(ids, recs, zero_width)
            choice = {"index": sub.index, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason}
            if req.return_token_ids:  # vLLM's extension, as the stream carries it
                choice.update(prompt_token_ids=list(o.prompt_token_ids), token_ids=list(o.token_ids))
            choices.append(choice)
        return self.answer(gen, "text_completion", choices, outs)

    def _stream(self, req: CompletionRequest, gen: Generation) -> AsyncIterator[str]:
        ids = TokenIdsOut(req.return_token_ids, gen)

        def chunk(sub: SubRequest, o: RequestOutput) -> dict[str, Any] | None:
            if not (o.delta_text or o.finished or o.delta_token_ids):
                return None
            lp = None
            if req.logprobs is not None and o.delta_logprobs:
                lp = self._logprobs(o.delta_token_ids, o.delta_logprobs)
            return {"choices": [{"index": sub.index, "text": o.delta_text, "logprobs": lp,
                                 "finish_reason": o.finish_reason if o.finished else None, **ids.take(sub)}],
                    **ids.prompt(sub)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self.sse_stream(gen, "text_completion", ids, include_usage, chunk)
