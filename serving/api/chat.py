"""`/v1/chat/completions` (vLLM's ``serving_chat``): the model's chat template, ``n`` choices, token
logprobs with ``top_logprobs``, SSE streaming, and vLLM's ``continue_final_message``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from serving.api.errors import APIError
from serving.api.generation import Generation, SubRequest
from serving.api.openai_serving import OpenAIServing, finite
from serving.api.protocol import ChatCompletionRequest, TextContentPart
from serving.api.sampling_factory import SamplingFactory
from serving.api.sse import TokenIdsOut
from serving.api.tool_calls import (
    StreamedChoice,
    ToolPlan,
    check_tool_results_reach_the_prompt,
    fallback_messages,
    plan_tools,
    split_calls,
    template_messages,
    without_calls,
)
from serving.api.tool_formats import call_format, template_takes_tools
from serving.api.tool_grammar import call_grammar
from serving.engine import RequestOutput


class ChatServing(OpenAIServing):
    async def create(self, request: Request) -> Any:
        req: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        fmt = call_format(self.tok) if plan is not None else None
        if plan is not None:
            plan = replace(plan, fmt=fmt)
        ids = self._prompt(req, plan)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        top = req.top_logprobs or 0
        held_to_calls = call_grammar(plan, fmt, self.tok) if plan is not None and plan.constrained else None
        make = SamplingFactory(req, self.state.engine.sampling_defaults, max_tokens,
                               top if req.logprobs else None, None, structured=held_to_calls)
        gen = self.start(request, "chatcmpl", [ids], make, req.model)
        if req.stream:
            return self.respond(request, self._stream(req, gen, top, plan))
        outs = await self.gather(gen, request)
        choices = [{"index": sub.index, **_message(o, plan),
                    "logprobs": self._logprobs(o.token_ids, o.outputs[0].logprobs, top) if req.logprobs else None}
                   for sub, o in zip(gen.subs, outs)]
        return self.respond(request, self.answer(gen, "chat.completion", choices, outs))

    def _prompt(self, req: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
        tok = self.tok
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        messages = [{**_tool_fields(m, i), "role": m.role, "content": _text_of(m.content, f"messages.{i}.content")}
                    for i, m in enumerate(req.messages)]
        text = self._render(req, messages, plan)
        check_tool_results_reach_the_prompt(messages, text)
        called = [i for i, m in enumerate(messages) if m.get("tool_calls")]
        if called and self._calls_left_out(req, messages, plan, text):
            raise APIError(400, f"messages.{called[0]}.tool_calls: this model's chat template leaves earlier tool "
                                "calls out of the prompt, so the model would not see what it called",
                           param=f"messages.{called[0]}.tool_calls")
        return tok.encode(text, add_special_tokens=False)

    def _calls_left_out(self, req: ChatCompletionRequest, messages: list[dict], plan: ToolPlan | None,
                        text: str) -> bool:
        """Whether the prompt is the same with the earlier calls taken out: then the template never showed them.
        A template that refuses the conversation without them (a result with no call before it) reads them."""
        try:
            return self._render(req, without_calls(messages), plan) == text
        except APIError:
            return False

    def _render(self, req: ChatCompletionRequest, messages: list[dict], plan: ToolPlan | None) -> str:
        """The prompt's text: the conversation, tools and earlier calls written as the chat template reads them."""
        tok = self.tok
        tools = [dict(t) for t in plan.tools] if plan is not None else None
        if template_takes_tools(tok):  # earlier calls and results as the template reads them, tools sent or not
            messages = template_messages(messages, tok.chat_template, call_format(tok))
        elif plan is not None:
            messages = fallback_messages(messages, plan)
        try:
            return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message)
        except Exception as e:  # template errors come from user content (jinja raise_exception)
            raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e

    def _logprobs(self, token_ids: list[int], recs: list[dict[int, float]] | None, top: int) -> dict[str, Any] | None:
        if recs is None:
            return None
        content = []
        for tid, rec in zip(token_ids, recs):
            s = self.token_str(tid)
            best = sorted(rec.items(), key=lambda kv: -kv[1])[:top]
            alts = [{"token": self.token_str(t), "logprob": finite(v), "bytes": list(self.token_str(t).encode())}
                    for t, v in best]
            content.append({"token": s, "logprob": finite(rec.get(tid)), "bytes": list(s.encode()),
                            "top_logprobs": alts})
        return {"content": content}

    def _stream(self, req: ChatCompletionRequest, gen: Generation, top: int,
                plan: ToolPlan | None) -> AsyncIterator[str]:
        ids = TokenIdsOut(req.return_token_ids, gen)
        readers = {sub.index: StreamedChoice(plan) for sub in gen.subs} if plan is not None else {}

        def opening() -> list[dict[str, Any]]:  # the role first, once per choice
            return [{"choices": [{"index": sub.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}], **ids.prompt(sub)} for sub in gen.subs]

        def chunk(sub: SubRequest, o: RequestOutput) -> dict[str, Any] | None:
            if not (o.delta_text or o.finished):
                return None
            text, calls, reason = o.delta_text, [], o.finish_reason if o.finished else None
            if sub.index in readers:
                text, calls, reason = readers[sub.index].feed(o.delta_text, reason)
                if not (text or calls or reason):
                    return None
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            lp = self._logprobs(o.delta_token_ids, o.delta_logprobs, top) if req.logprobs else None
            return {"choices": [{"index": sub.index, "delta": delta, "logprobs": lp, "finish_reason": reason,
                                 **ids.take(sub)}]}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self.sse_stream(gen, "chat.completion.chunk", ids, include_usage, chunk, opening)


def _message(o: RequestOutput, plan: ToolPlan | None) -> dict[str, Any]:
    """A whole choice's ``message`` and ``finish_reason``: the calls it makes (with any text it wrote before them),
    or its text."""
    content, calls = split_calls(o.text, plan) if plan is not None and o.finish_reason == "stop" else (o.text, None)
    if calls:
        return {"message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason}


def _tool_fields(message: Any, i: int) -> dict[str, Any]:
    """An assistant message's earlier ``tool_calls`` and a tool message's ``tool_call_id``, as the template reads
    them (and the fallback rewrites them)."""
    extra = message.model_extra or {}
    out = {}
    if isinstance(extra.get("tool_calls"), list):
        for j, call in enumerate(extra["tool_calls"]):
            if not (isinstance(call, dict) and isinstance(call.get("function"), dict)
                    and isinstance(call["function"].get("name"), str)):
                raise APIError(400, f"messages.{i}.tool_calls.{j}.function.name: a call needs a function name",
                               param=f"messages.{i}.tool_calls.{j}.function.name")
        out["tool_calls"] = extra["tool_calls"]
    if isinstance(extra.get("tool_call_id"), str):
        out["tool_call_id"] = extra["tool_call_id"]
    return out


def _text_of(content: str | list[TextContentPart] | None, where: str) -> str:
    """A message's text for the chat template. The model reads text only: a part it cannot read (an image,
    audio, a file) is refused rather than dropped, since an answer that never saw it would look like one
    that did."""
    if not isinstance(content, list):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "text":
            what = "images are" if "image" in part.type else f"content parts of type `{part.type}` are"
            raise APIError(400, f"{where}.{j}: {what} not supported: this model reads text only; send `text` "
                                "parts", param=f"{where}.{j}")
        if part.text is None:
            raise APIError(400, f"{where}.{j}.text: a text part needs a string `text`", param=f"{where}.{j}.text")
    return "".join(part.text for part in content)
