"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens (the prefix/read offsets of HF's streamers and
vLLM): the window's new text is emitted only when it does not end in U+FFFD, so a multi-byte UTF-8
character split across tokens is never emitted half-way. Stop strings are searched in the full
output text; the last ``max(len(stop)) - 1`` characters are held back while generating so a stop
string is never streamed, even partly; on a match the text is cut before it.

This runs for every sequence on every step, in the engine core, so the window is decoded by ``tokenizers``'
``DecodeStream`` (one call into Rust per token) whenever the tokenizer is a fast one. The same algorithm
in Python (two ``tokenizer.decode`` calls per token, each through transformers' wrapper) is kept for slow
tokenizers and as the fallback when the stream refuses a window (``_StreamDecoder``).
"""

from __future__ import annotations

from typing import Any

# how many prompt tokens seed the window, so the first output token decodes with its real context
_PROMPT_CONTEXT = 5


class WindowDecoder:
    """The window algorithm over ``tokenizer.decode``: works with any HF tokenizer, slow ones included.

    ``ids[prefix_offset:read_offset]`` decodes to the text already emitted (as context), and the new text is
    what ``ids[prefix_offset:]`` adds to it."""

    def __init__(self, tokenizer: Any, ids: list[int], skip_special_tokens: bool,
                 prefix_offset: int = 0, read_offset: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = ids
        self.prefix_offset = prefix_offset
        self.read_offset = len(ids) if read_offset is None else read_offset

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Append one token; the text it completes ("" while a character is still partial)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""


class StreamDecoder:
    """The same window, kept and decoded in Rust by ``tokenizers.decoders.DecodeStream``.

    ``DecodeStream`` checks that each window's text starts with the text of the window before; a decoder
    for which that does not hold makes it raise. Then this request goes on with ``WindowDecoder``, from the
    very state the stream had (the window's offsets are mirrored here: one list append per token), so the
    text stays what the Python algorithm would have produced.
    """

    def __init__(self, tokenizer: Any, backend: Any, context: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.fallback: WindowDecoder | None = None

    def step(self, token_id: int) -> str:
        """Append one token; the text it completes ("" while a character is still partial)."""
        if self.fallback is not None:
            return self.fallback.step(token_id)
        try:
            new = self.stream.step(self.backend, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for a window it refuses
            self.fallback = WindowDecoder(self.tokenizer, self.ids, self.skip_special_tokens,
                                          self.prefix_offset, self.read_offset)
            return self.fallback.step(token_id)
        self.ids.append(token_id)
        if new is None:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new


def make_decoder(tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool) -> StreamDecoder | WindowDecoder:
    """The fastest decoder that gives the Python algorithm's text for this tokenizer and prompt.

    ``DecodeStream`` primed with a context that decodes to a partial character (a prompt of token ids cut
    mid-character) would stream that context's text as output; such a prompt takes the Python window."""
    context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
    backend = _rust_tokenizer(tokenizer)
    if backend is None or backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return WindowDecoder(tokenizer, context, skip_special_tokens)
    return StreamDecoder(tokenizer, backend, context, skip_special_tokens)


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast HF tokenizer whose ``decode`` is exactly its decode (no
    clean-up pass); None for a slow tokenizer."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """One request's output text: what is safe to stream, and where a stop string cut it."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.decoder = make_decoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # full output text so far (cut at a stop string once found)
        self.emitted = 0  # characters of ``text`` already handed to the caller
        self.stopped_on: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut)."""
        new = self.decoder.step(token_id)
        if not new:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            j = self.text.find(s, start)
            if j != -1 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return None
        j, s = best
        self.text = self.text[:j + len(s) if self.include_stop else j]
        self.stopped_on = s
        return s

    def delta(self, finished: bool) -> str:
        """New text safe to stream now; when ``finished``, everything left."""
        end = len(self.text) if (finished or self.stopped_on) else max(self.emitted,
                                                                       len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
