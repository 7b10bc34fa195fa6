"""The embedded model's tokenizer: byte-level BPE trained on the synthetic corpus.

Why this shape: the pre-tokenizer isolates every ASCII letter and digit, so numbers and words reach the
model one character per token. A 4M-parameter model cannot learn the spelling of hundreds of merged
tokens or carry digits hidden inside multi-digit tokens; with one token per character, addition and
string reversal become position-wise problems it can learn in minutes. BPE still merges the runs of
spaces and punctuation (``" + "``, ``"?"``), and the byte-level alphabet means any text encodes.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END)

# `<s>` then per message `<|role|>\n{content}<|end|>\n`; with add_generation_prompt: `<|assistant|>\n`.
CHAT_TEMPLATE = (
    "{{ '<s>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_ROLES = ("system", "user", "assistant")


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (no tokenizer needed); a test keeps the two identical."""
    parts = [BOS]
    for message in messages:
        if message["role"] not in _ROLES:
            raise ValueError(f"role: unknown chat role {message['role']!r}")
        parts.append(f"<|{message['role']}|>\n{message['content']}{END}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT}\n")
    return "".join(parts)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the BPE on ``texts`` and wrap it with special tokens and the chat template."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[A-Za-z0-9]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def end_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids that stop generation: ``<|end|>`` closes an assistant turn, ``</s>`` a document."""
    return [tokenizer.convert_tokens_to_ids(END), tokenizer.convert_tokens_to_ids(EOS)]
