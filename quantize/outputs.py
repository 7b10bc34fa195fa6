"""What a quantized model directory carries besides its weights, and how big its weights are.

Quantizers write through ``artifacts.common.atomic.staged_directory``: a crash leaves no half-written
model dir that a later stage would take for a finished one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Files a quantizer does not own but a loader needs: copied verbatim from the full-precision dir so
# the chat template, special tokens and eos ids are exactly the source's.
SIDECAR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def copy_sidecars(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer files and generation_config.json from `src` over whatever `dst` has."""
    copied = []
    for name in SIDECAR_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def weights_size(model_dir: Path) -> int:
    """Bytes of weight files in a model dir (what 'size on disk' means in the fidelity report)."""
    return sum(p.stat().st_size for p in Path(model_dir).rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
