"""Package attributes that import their module on first use (PEP 562), so a light part of a package (its
config, its errors) imports without the heavy stack (torch) the rest pulls in."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` for ``package`` and its sorted ``__all__``: each name of ``modules[m]`` is
    read from module ``m`` when first asked for."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__, sorted(where)
