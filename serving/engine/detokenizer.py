"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens (the prefix/read offsets of HF's streamers and
vLLM): the window's new text is emitted only when it does not end in U+FFFD, so a multi-byte UTF-8
character split across tokens is never emitted half-way. Stop strings are searched in the full
output text; the last ``max(len(stop)) - 1`` characters are held back while generating so a stop
string is never streamed, even partly; on a match the text is cut before it.
"""

from __future__ import annotations

from typing import Any

# how many prompt tokens seed the window, so the first output token decodes with its real context
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # full output text so far (cut at a stop string once found)
        self.emitted = 0  # characters of ``text`` already handed to the caller
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        else:
            new = ""
        if not new:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += new
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
