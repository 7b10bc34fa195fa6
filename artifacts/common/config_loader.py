"""YAML → dataclass conversion with errors a user can act on.

Each stage owns a config dataclass whose field names are the YAML keys (one place for defaults).
This module walks the YAML mapping against those dataclasses and refuses anything it does not
understand — an unknown key, a wrong type, a value the stage's `__post_init__` rejects — with one
line that names the file and the dotted key, e.g.
``configs/x.yaml: training.sft.lora.r: expected an integer, got 'eight'``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from artifacts.errors import ConfigError

T = TypeVar("T")


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping at its top level."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def build_dataclass(cls: type[T], data: Any, *, key: str, source: Path | str) -> T:
    """Build `cls` from a YAML mapping, naming `source` and the dotted `key` on any error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {key}: expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ConfigError(f"{source}: unknown key '{where}' (known keys: {', '.join(sorted(fields))})")
    kwargs = {
        name: _convert(hints[name], value, key=f"{key}.{name}" if key else name, source=source)
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {key or cls.__name__}: {exc}") from None


def _convert(hint: Any, value: Any, *, key: str, source: Path | str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(option, value, key=key, source=source)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{source}: {key}: {_describe(value)} fits none of {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}: expected a list, got {_describe(value)}")
        item_hint = args[0] if args else Any
        items = [_convert(item_hint, v, key=f"{key}[{i}]", source=source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {_describe(value)}")
        key_hint, value_hint = args if args else (Any, Any)
        return {
            _convert(key_hint, k, key=key, source=source): _convert(value_hint, v, key=f"{key}.{k}", source=source)
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, key=key, source=source)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}: expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}: expected a string, got {_describe(value)}")
        return value
    if hint is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}: expected a path string, got {_describe(value)}")
        return Path(value)
    raise ConfigError(f"{source}: {key}: unsupported config type {_type_name(hint)}")


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__}"
    return repr(value)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
