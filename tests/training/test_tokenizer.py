"""Tokenizer: round-trips, one token per digit/letter, the contract's chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from training.tokenizer import SPECIAL_TOKENS, render_chat, train_tokenizer

TEXTS = ["<s><|user|>\nWhat is 37 + 48?<|end|>\n<|assistant|>\nAnswer: 85<|end|>\n</s>",
         "The word cat reversed is tac.", "A small dog sees a red ball in the park."] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, vocab_size=300).save_pretrained(out)
    return out


def test_round_trip_including_unseen_bytes(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in ["What is 99 + 1?", "héllo wörld ✓ 世界", "  spaces\tand\nnewlines  ", TEXTS[0]]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_are_single_ids(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for token in SPECIAL_TOKENS:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [token]
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"


def test_digits_and_letters_are_one_token_each(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.tokenize("12345") == list("12345")
    assert tok.tokenize("tac") == list("tac")


def test_chat_template_renders_the_contract_format(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": "Answer: 3"}]
    expected = ("<s><|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 1 + 2?<|end|>\n"
                "<|assistant|>\nAnswer: 3<|end|>\n")
    assert tok.apply_chat_template(messages, tokenize=False) == expected == render_chat(messages)
    prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>\nWhat is 1 + 2?<|end|>\n<|assistant|>\n"
    ids = tok.apply_chat_template(messages[1:2], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_render_chat_rejects_unknown_roles() -> None:
    with pytest.raises(ValueError, match="^role:"):
        render_chat([{"role": "tool", "content": "x"}])
