"""The embedded base model as shipped with the package: the same weights on every host.

Why: pretraining is float arithmetic, and float arithmetic differs between CPU families. The same recipe,
pretrained from the same seed, gave a base that answered 9% of held-out sums on an Intel host and 93% on an AMD
one (issue 30), so the whole lifecycle told a different story per machine. The package therefore ships the
checkpoint that the project's own pretraining built once (``python -m training.ship_base``), with the sha256
of every file. Whenever a recipe asks for exactly the model it was built from (the same recipe digest), the
pipeline installs this copy instead of pretraining: seconds instead of minutes, and bit-identical everywhere.
``shipped: false`` in a recipe's ``base.embedded`` section pretrains here instead.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.digests import sha256_file
from artifacts.errors import LifecycleError

SHIPPED_DIR = Path(__file__).parent / "embedded_base"
DIGESTS_FILE = "digests.json"
WEIGHTS_FILE = "model.safetensors"


class ShippedBaseError(LifecycleError):
    """The shipped checkpoint (or an installed copy of it) does not match its digests; names file and reason."""


@dataclass(frozen=True)
class ShippedBase:
    """The checkpoint in the package: where it is, which recipe built it, and the sha256 of each file."""

    path: Path
    recipe_digest: str
    files: dict[str, str]
    built: dict[str, Any] = field(default_factory=dict)  # host, torch version, date, command

    @property
    def weights_sha256(self) -> str:
        return self.files[WEIGHTS_FILE]

    def to_json(self) -> dict[str, Any]:
        return {"recipe_digest": self.recipe_digest, "files": dict(sorted(self.files.items())), "built": self.built}


def load_shipped(directory: Path = SHIPPED_DIR) -> ShippedBase | None:
    """The checkpoint shipped in ``directory``, or None where the package carries none."""
    digests = directory / DIGESTS_FILE
    if not digests.is_file():
        return None
    try:
        raw = json.loads(digests.read_text())
        return ShippedBase(directory, str(raw["recipe_digest"]), {str(k): str(v) for k, v in raw["files"].items()},
                           dict(raw.get("built") or {}))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ShippedBaseError(f"{digests}: not a digests file ({exc})") from None


def shipped_for(recipe_digest: str, directory: Path = SHIPPED_DIR) -> ShippedBase | None:
    """The shipped checkpoint when it was built from the recipe with this digest, else None."""
    shipped = load_shipped(directory)
    return shipped if shipped is not None and shipped.recipe_digest == recipe_digest else None


def verify_files(directory: Path, files: dict[str, str]) -> None:
    """Every file in ``files`` is in ``directory`` with that sha256; the error names the first that is not."""
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise ShippedBaseError(f"{path}: missing (the shipped base model lists it in {DIGESTS_FILE})")
        actual = sha256_file(path)
        if actual != expected:
            raise ShippedBaseError(f"{path}: sha256 {actual[:16]}… is not the shipped {expected[:16]}… "
                                   f"(the file was changed; reinstall the package or set base.embedded.shipped: "
                                   f"false to pretrain here)")


def install_shipped(shipped: ShippedBase, out_dir: Path) -> None:
    """Copy the shipped checkpoint into ``out_dir`` (a staging directory) and check the copy."""
    verify_files(shipped.path, shipped.files)
    for name in (*shipped.files, DIGESTS_FILE):  # the digests travel with the copy: its provenance
        shutil.copyfile(shipped.path / name, out_dir / name)
    verify_files(out_dir, shipped.files)
