"""Write the base model the package ships (``training/embedded_base``): pretrained once, with its digests.

Maintainers run this after a change to the corpus, a preset or the pretraining code (``RECIPE_VERSION``), and
commit the result; users never need to (``training.shipped_base`` says why the package ships one):

    .venv/bin/python -m training.ship_base configs/default.yaml            # pretrain the recipe's base here
    .venv/bin/python -m training.ship_base configs/default.yaml --from DIR  # ship a base already pretrained

``--from`` takes a directory the pipeline pretrained (``models/base/<digest>``) and refuses one whose
``recipe.json`` is another recipe's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from artifacts.common.atomic import atomic_write_json, staged_directory
from artifacts.common.config_loader import build_dataclass, read_yaml_mapping
from artifacts.common.host import cpuinfo_field
from artifacts.digests import sha256_file
from artifacts.errors import LifecycleError
from training.base_model import RECIPE_FILE, BaseModelConfig, _train_into
from training.shipped_base import DIGESTS_FILE, SHIPPED_DIR, WEIGHTS_FILE, ShippedBase


def host_cpu() -> str:
    """The CPU model as ``lscpu`` names it (the shipped base records the host that pretrained it)."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def ship(config: BaseModelConfig, directory: Path = SHIPPED_DIR, source: Path | None = None) -> ShippedBase:
    """Pretrain ``config``'s base (or take ``source``, pretrained from the same recipe) and publish it in
    ``directory`` with the sha256 of every file; the old contents are replaced in one rename."""
    digest = config.digest()
    if source is not None:
        if not source.is_dir():
            raise LifecycleError(f"{source}: not a directory (--from takes a base the pipeline pretrained)")
        recipe = json.loads((source / RECIPE_FILE).read_text()) if (source / RECIPE_FILE).is_file() else {}
        if recipe.get("digest") != digest:
            raise LifecycleError(f"{source / RECIPE_FILE}: recipe digest {str(recipe.get('digest'))[:16]} is not "
                                 f"this recipe's {digest[:16]}")
    start = time.time()
    with staged_directory(directory, if_exists="replace") as tmp:
        if source is not None:
            for path in sorted(source.iterdir()):
                if path.is_file() and path.name != DIGESTS_FILE:
                    shutil.copyfile(path, tmp / path.name)
        else:
            _train_into(dataclasses.replace(config, shipped=False), tmp)
        if not (tmp / WEIGHTS_FILE).is_file():
            raise LifecycleError(f"{source or directory}: no {WEIGHTS_FILE} to ship")
        files = {path.name: sha256_file(path) for path in sorted(tmp.iterdir()) if path.is_file()}
        built = {"host_cpu": host_cpu(), "torch": torch.__version__, "python": platform.python_version(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
                 "command": "python -m training.ship_base " + " ".join(sys.argv[1:])}
        shipped = ShippedBase(directory, digest, files, built)
        atomic_write_json(tmp / DIGESTS_FILE, shipped.to_json())
    return shipped


def embedded_config(recipe_path: Path) -> BaseModelConfig:
    """The ``base.embedded`` section of a recipe file (read here, not through the flows' recipe loader: the
    training room does not reach up into the pipeline's)."""
    base = read_yaml_mapping(recipe_path).get("base") or {}
    if not isinstance(base, dict):
        raise LifecycleError(f"{recipe_path}: base: expected a mapping")
    if base.get("source", "embedded") != "embedded":
        raise LifecycleError(f"{recipe_path}: base.source is {base['source']!r}, not embedded")
    return build_dataclass(BaseModelConfig, base.get("embedded"), key="base.embedded", source=recipe_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, help="the recipe whose base.embedded section the package ships")
    parser.add_argument("--from", dest="source", type=Path, help="a base already pretrained from that recipe")
    parser.add_argument("--into", type=Path, default=SHIPPED_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        shipped = ship(embedded_config(args.recipe), args.into, args.source)
    except LifecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"shipped {shipped.path} (recipe {shipped.recipe_digest[:16]}, weights sha256 {shipped.weights_sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
