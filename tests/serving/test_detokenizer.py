"""Incremental detokenizer: never half a UTF-8 character, never a stop string on the wire; tokenizers'
``DecodeStream`` (fast tokenizers) gives the same text as the Python window (slow tokenizers, fallback)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer

from serving.engine.detokenizer import IncrementalDetokenizer, StreamDecoder, WindowDecoder, make_decoder
from training.tokenizer import train_tokenizer


class SlowTokenizer:
    """Only the slow tokenizer's interface (``decode``, no Rust backend): the detokenizer's Python path."""

    def __init__(self, fast) -> None:
        self.fast = fast

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text)

    def decode(self, ids: list[int], **kwargs) -> str:
        return self.fast.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def fast_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", params=["fast", "slow"])
def tok(request, fast_tok):
    return fast_tok if request.param == "fast" else SlowTokenizer(fast_tok)


@pytest.fixture(scope="module")
def embedded_tok():
    """The pipeline's own tokenizer (one token per letter and digit, byte-level for the rest)."""
    return train_tokenizer(["What is 37 + 48? Answer: 85", "Grüße, naïve café ✓ 世界", "The cat sat."] * 10,
                           vocab_size=300)


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


def test_a_fast_tokenizer_streams_in_rust_and_a_slow_one_decodes_windows(fast_tok):
    assert isinstance(IncrementalDetokenizer(fast_tok, [1, 2]).decoder, StreamDecoder)
    assert isinstance(IncrementalDetokenizer(SlowTokenizer(fast_tok), [1, 2]).decoder, WindowDecoder)


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


def test_the_first_token_keeps_its_leading_space_from_the_prompt(tok):
    chunks, _ = stream(tok, " world", prompt="Hello")
    assert "".join(chunks) == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tok, skip):
    ids = tok.encode("Hello<|end|> world</s>")
    d = IncrementalDetokenizer(tok, tok.encode("<|assistant|>\n"), skip_special_tokens=skip)
    for t in ids:
        d.add_token(t)
    assert d.delta(True) == ("Hello world" if skip else "Hello<|end|> world</s>")


def _texts(tok, prompt: list[int], out: list[int], skip: bool) -> tuple[list[str], list[str]]:
    """Per token, the text the Rust stream and the Python window emit."""
    window = WindowDecoder(SlowTokenizer(tok), list(prompt[-5:]), skip)
    fast = make_decoder(tok, prompt, skip)
    return [fast.step(t) for t in out], [window.step(t) for t in out]


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_the_stream_gives_the_windows_text_token_by_token_on_real_text(which, fast_tok, embedded_tok):
    tok = fast_tok if which == "tiny" else embedded_tok
    texts = ["Grüße aus München — ça va? naïve café", " 日本語のテキスト 🙂🚀 emoji", "What is 37 + 48?<|end|>\n",
             "<|assistant|>\nAnswer: 85</s> and ✓ 世界 done"]
    specials = [tok.convert_tokens_to_ids(s) for s in ("<s>", "</s>", "<|end|>")]
    for i, text in enumerate(texts):
        prompt = tok.encode(texts[i - 1])
        out = tok.encode(text)
        out[len(out) // 2:len(out) // 2] = specials  # special tokens in the middle of a character run
        for skip in (True, False):
            fast, window = _texts(tok, prompt, out, skip)
            assert fast == window, (text, skip)
            assert "".join(fast) == tok.decode(prompt[-5:] + out, skip_special_tokens=skip)[
                len(tok.decode(prompt[-5:], skip_special_tokens=skip)):]


def test_the_stream_gives_the_windows_text_on_random_token_ids(fast_tok):
    """Random ids: lone UTF-8 bytes, characters completed by later tokens, specials anywhere, prompts cut
    mid-character (those take the window from the start)."""
    rng = random.Random(0)
    vocab = len(fast_tok)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        skip = rng.random() < 0.5
        fast, window = _texts(fast_tok, prompt, out, skip)
        assert fast == window, (prompt, out, skip)


def test_a_prompt_cut_mid_character_never_leaks_into_the_output(fast_tok):
    lead = next(t for t in range(len(fast_tok)) if fast_tok.decode([t]) == "\ufffd")  # a lone lead byte
    prompt = fast_tok.encode("Hi") + [lead]
    d = IncrementalDetokenizer(fast_tok, prompt)
    for t in fast_tok.encode(" ok"):
        d.add_token(t)
    assert d.delta(True) == " ok"


class _ReversingDecoder:
    """A decoder whose text for a window is not an extension of the text of a shorter one."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return list(reversed(tokens))


class _Shim:
    """A fast tokenizer's two faces over one Rust tokenizer: ``backend_tokenizer`` and ``decode``."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend_tokenizer = backend

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_window_the_stream_refuses_goes_on_in_python_with_the_same_text():
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.Decoder.custom(_ReversingDecoder())
    shim = _Shim(backend)
    fast = make_decoder(shim, [], False)
    assert isinstance(fast, StreamDecoder)
    window = WindowDecoder(shim, [], False)
    out = [1, 2, 3, 1, 2]
    assert [fast.step(t) for t in out] == [window.step(t) for t in out]
    assert fast.fallback is not None  # the stream raised, and the window took over
