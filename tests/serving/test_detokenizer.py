"""Incremental detokenizer: never half a UTF-8 character, never a stop string on the wire."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from serving.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tok, text: str, stop=None, prompt="Hi"):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    chunks = []
    for i, t in enumerate(ids):
        hit = d.add_token(t)
        chunks.append(d.delta(finished=hit is not None or i == len(ids) - 1))
        if hit:
            break
    return chunks, d


def test_multibyte_characters_split_across_tokens_are_never_emitted_half(tok):
    text = "Grüße 🙂🚀 日本語 ok"
    ids = tok.encode(text)
    # byte-level BPE: at least one token is an incomplete UTF-8 sequence on its own
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    chunks, _ = stream(tok, text)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text


def test_stop_string_is_cut_and_never_streamed_even_partly(tok):
    text = "Hello world! Answer: 42. Question: what"
    chunks, d = stream(tok, text, stop=["Question:"])
    assert d.stopped_on == "Question:"
    assert "".join(chunks) == "Hello world! Answer: 42. "
    seen = ""
    for c in chunks:
        seen += c
        assert "Q" not in seen  # not even the stop's first character left the detokenizer early


def test_earliest_of_several_stop_strings_wins(tok):
    chunks, d = stream(tok, "The quick brown fox jumps", stop=["fox", "quick"])
    assert d.stopped_on == "quick" and "".join(chunks) == "The "


def test_held_back_tail_is_flushed_when_generation_ends_without_a_stop(tok):
    chunks, d = stream(tok, "a lazy dog.", stop=["dog!"])
    assert d.stopped_on is None and "".join(chunks) == "a lazy dog."


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world! Answer")
    d = IncrementalDetokenizer(tok, [], ["world"], include_stop_str_in_output=True)
    for t in ids:
        if d.add_token(t):
            break
    assert d.delta(True) == "Hello world"
