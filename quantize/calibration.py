"""Calibration sets for GPTQ/AWQ: training-distribution text, tokenized into fixed-length windows.

The texts are packed (each text framed by bos/eos unless it already is, concatenated) and cut into windows of
`seq_len` tokens, so short chat records still give full-length samples as GPTQ's Hessian estimate
wants. The digest covers the exact token ids fed to the quantizer, so two runs with equal digests
calibrated on identical input; it is recorded in the result and the bundle manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.digests import digest_json, sha256_file
from artifacts.jsonl import iter_jsonl
from quantize.errors import QuantizeError

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.jsonl"
HELDOUT_TEXT_FILE = "text_heldout.jsonl"
MIN_WINDOW = 16


@dataclass
class CalibrationSet:
    """Token windows for the quantizer, with where they came from."""

    input_ids: list[list[int]]
    seq_len: int
    source: Path
    source_sha256: str
    digest: str

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)

    def as_gptqmodel_examples(self) -> list[dict[str, list[int]]]:
        """The list-of-dicts form gptqmodel's `quantize()` accepts (already tokenized, no padding)."""
        return [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in self.input_ids]


def load_texts(path: Path, limit: int | None = None) -> list[str]:
    """Read `{"text": ...}` records from a JSONL file; bad lines raise QuantizeError naming file:line."""
    path = Path(path)
    texts: list[str] = []
    hint = 'file not found (expected JSONL with one {"text": ...} per line)'
    for lineno, record in iter_jsonl(path, QuantizeError, hint):
        if not isinstance(record.get("text"), str):
            raise QuantizeError(f"{path}:{lineno}: expected an object with a string field 'text'")
        if record["text"].strip():
            texts.append(record["text"])
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise QuantizeError(f"{path}: no non-empty 'text' records")
    return texts


def resolve_calibration_file(source: Path) -> Path:
    """A data-stage directory means its calibration.jsonl; a file is taken as the user's own JSONL."""
    source = Path(source)
    return source / CALIBRATION_FILE if source.is_dir() else source


def _special_id(tokenizer: Any, name: str) -> int | None:
    value = getattr(tokenizer, f"{name}_token_id", None)
    return value if isinstance(value, int) else None


def build_calibration_set(source: Path, tokenizer: Any, num_samples: int, seq_len: int) -> CalibrationSet:
    """Pack the texts into `num_samples` windows of `seq_len` tokens (fewer if the text runs out)."""
    path = resolve_calibration_file(source)
    texts = load_texts(path)
    bos, eos = _special_id(tokenizer, "bos"), _special_id(tokenizer, "eos")
    budget = num_samples * seq_len
    stream: list[int] = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        # Data-stage texts may already start with the literal bos (chat-rendered records): never double it.
        if bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        if eos is not None and ids[-1:] != [eos]:
            ids.append(eos)
        stream.extend(ids)
        if len(stream) >= budget:
            break
    windows = [stream[i : i + seq_len] for i in range(0, min(len(stream), budget), seq_len)]
    # A short tail window would weigh a handful of tokens like a full sample: keep it only if it is long.
    windows = [w for w in windows if len(w) >= MIN_WINDOW] or ([stream] if len(stream) >= 2 else [])
    if not windows:
        raise QuantizeError(f"{path}: texts tokenize to fewer than 2 tokens; nothing to calibrate on")
    if len(windows) < num_samples:
        log.warning(
            "calibration: %s holds %d tokens, enough for %d of %d windows of %d tokens",
            path, len(stream), len(windows), num_samples, seq_len,
        )
    digest = digest_json({"seq_len": seq_len, "input_ids": windows})
    log.info("calibration: %d windows x %d tokens from %s (digest %s)", len(windows), seq_len, path, digest[:12])
    return CalibrationSet(
        input_ids=windows, seq_len=seq_len, source=path, source_sha256=sha256_file(path), digest=digest
    )
