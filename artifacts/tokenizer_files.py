"""The tokenizer half of a bundle: which files, how many tokens, and a chat template that renders.

Why without transformers: the verifier runs before a server loads anything and must stay fast; the vocab
size comes from `tokenizers` (tokenizer.json) and the chat template is rendered with the same sandboxed
Jinja settings transformers uses (trim_blocks, lstrip_blocks, `raise_exception`), so a template that
renders here renders in `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from artifacts.digests import digest_json, sha256_bytes, sha256_file
from artifacts.manifest import TokenizerInfo

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)
_PROBE = "bundle-verify probe"


class TokenizerFilesError(ValueError):
    """Raised with (file, reason) so callers can turn it into their own one-line error."""

    def __init__(self, file: str, reason: str) -> None:
        self.file, self.reason = file, reason
        super().__init__(f"{file}: {reason}")


def tokenizer_files(directory: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (directory / name).is_file()]


def tokenizer_digest(directory: Path, files: list[str]) -> str:
    return digest_json({name: sha256_file(directory / name) for name in files})


def tokenizer_vocab_size(directory: Path) -> int:
    """Tokens the tokenizer can emit, added/special tokens included (what must fit the embedding)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise TokenizerFilesError("tokenizer.json", "missing (a bundle needs a fast tokenizer file)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerFilesError("tokenizer.json", f"cannot be read ({exc})") from exc


def _read_json(directory: Path, name: str) -> dict[str, Any]:
    path = directory / name
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerFilesError(name, f"not valid JSON ({exc.msg})") from exc


def load_chat_template(directory: Path) -> tuple[str, str]:
    """(template, file it came from): chat_template.jinja wins, as in transformers' loader."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8"), "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = _read_json(directory, name).get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str) and template:
            return template, name
    raise TokenizerFilesError("tokenizer_config.json", "no chat_template (a bundle must carry one)")


def chat_template_digest(template: str) -> str:
    return sha256_bytes(template.encode("utf-8"))


def _special_tokens(directory: Path) -> dict[str, str]:
    config = _read_json(directory, "tokenizer_config.json")
    tokens = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        tokens[key] = value or ""
    return tokens


def render_probe(template: str, directory: Path) -> str:
    """Render a one-turn and a two-turn conversation; raise if either fails or drops the message."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    special = _special_tokens(directory)
    user = {"role": "user", "content": _PROBE}
    try:
        compiled = env.from_string(template)
        prompt = compiled.render(messages=[user], add_generation_prompt=True, **special)
        compiled.render(messages=[user, {"role": "assistant", "content": "ok"}], add_generation_prompt=False,
                        **special)
    except Exception as exc:  # any Jinja or template-raised error means a server could not format a chat
        raise TokenizerFilesError("chat_template", f"fails to render ({type(exc).__name__}: {exc})") from exc
    if _PROBE not in prompt:
        raise TokenizerFilesError("chat_template", "renders without the user message")
    return prompt


def read_tokenizer(directory: Path) -> tuple[TokenizerInfo, str]:
    """What a manifest records of `directory`'s tokenizer, and the chat template's text (to render it).

    Raises TokenizerFilesError for a tokenizer.json that is missing or unreadable, or no chat template."""
    vocab = tokenizer_vocab_size(directory)
    template, source = load_chat_template(directory)
    files = tokenizer_files(directory)
    info = TokenizerInfo(digest=tokenizer_digest(directory, files), vocab_size=vocab, files=files,
                         chat_template_digest=chat_template_digest(template), chat_template_source=source)
    return info, template
