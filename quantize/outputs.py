"""Writing model directories safely: stage in a temp dir beside the target, then one rename.

A crash mid-quantization leaves a `.name.tmp-*` dir (removed on the next attempt's failure path),
never a half-written model dir that a later stage would take for a finished one.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """Yield an empty temp dir; on success it replaces `out_dir` by rename, on error it is removed."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the renamed model dir should read like any other
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


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
