"""Resume and skip: which checkpoint a re-run continues from, and the marker of a finished fine-tune.

Layout of a fine-tune's output dir: the merged HF model at the top, `adapter/`, `checkpoints/checkpoint-N/`
while training, `stage_result.json`, and `.training-finished.json` written last by one atomic rename. A re-run
with the same fingerprint (stage config + input model + data digests) skips a finished fine-tune and resumes an
unfinished one from its newest complete checkpoint; a different fingerprint starts it over.

The marker belongs to training, not to the pipeline: it holds the fingerprint a finished fine-tune was trained
for, and it is what a re-run and the distributed launcher (rank 0 writes it) check. Whether a pipeline stage is
done is the flow's `STAGE_DONE.json` one directory up (flows.stage_runner), written after the stage's MLflow
logging.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json
from artifacts.digests import digest_json, sha256_file

FINISHED_MARKER = ".training-finished.json"
CHECKPOINTS_DIR = "checkpoints"
FINGERPRINT_NAME = "fingerprint.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def model_dir_digest(model_dir: Path) -> str:
    """Cheap identity of a model dir: JSON files hashed in full, weight files by name and size."""
    entries = {}
    for item in sorted(Path(model_dir).iterdir()):
        if not item.is_file():
            continue
        if item.suffix == ".json" or item.name.endswith(".jinja"):
            entries[item.name] = sha256_file(item)
        elif item.name.endswith(_WEIGHT_SUFFIXES):
            entries[item.name] = item.stat().st_size
    return digest_json(entries)


def stage_fingerprint(stage: str, config: dict[str, Any], model_dir: Path, data_digests: dict[str, str]) -> str:
    return digest_json({"stage": stage, "config": config, "model": model_dir_digest(model_dir),
                        "data": data_digests})


def read_finished_marker(output_dir: Path) -> dict[str, Any] | None:
    path = Path(output_dir) / FINISHED_MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def write_finished_marker(output_dir: Path, fingerprint: str, extra: dict[str, Any] | None = None) -> None:
    atomic_write_json(Path(output_dir) / FINISHED_MARKER, {"fingerprint": fingerprint, **(extra or {})})


def training_finished(output_dir: Path, fingerprint: str) -> bool:
    """Whether `output_dir` holds a fine-tune finished for exactly this fingerprint."""
    marker = read_finished_marker(output_dir)
    return marker is not None and marker.get("fingerprint") == fingerprint


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[-1])


def _is_complete_checkpoint(path: Path) -> bool:
    """Trainer writes trainer_state.json last; a checkpoint killed mid-save lacks it or has it truncated."""
    state = path / "trainer_state.json"
    if not state.is_file():
        return False
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return True


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """Newest complete `checkpoint-N` under `checkpoints_dir`, or None."""
    if not checkpoints_dir.is_dir():
        return None
    found = [p for p in checkpoints_dir.glob("checkpoint-*") if p.is_dir() and p.name.rsplit("-", 1)[-1].isdigit()]
    for path in sorted(found, key=checkpoint_step, reverse=True):
        if _is_complete_checkpoint(path):
            return path
    return None


def prepare_checkpoints(output_dir: Path, fingerprint: str) -> tuple[Path, Path | None]:
    """The checkpoints dir for this run and the checkpoint to resume from (None: start fresh).

    Checkpoints left by a run with another fingerprint are deleted: resuming them would mix two recipes.
    """
    ckpt_dir = Path(output_dir) / CHECKPOINTS_DIR
    fp_file = ckpt_dir / FINGERPRINT_NAME
    if ckpt_dir.exists():
        try:
            previous = json.loads(fp_file.read_text(encoding="utf-8")).get("fingerprint")
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous != fingerprint:
            shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if not fp_file.exists():
        atomic_write_json(fp_file, {"fingerprint": fingerprint})
    return ckpt_dir, latest_checkpoint(ckpt_dir)


def clear_stale_outputs(output_dir: Path) -> None:
    """Drop the marker of a finished run with another fingerprint before this run rewrites the directory."""
    marker = Path(output_dir) / FINISHED_MARKER
    if marker.exists():
        marker.unlink()
