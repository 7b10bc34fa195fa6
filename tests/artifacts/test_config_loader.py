"""The YAML → dataclass loader names the file and the dotted key for every kind of mistake."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from artifacts.common.config_loader import build_dataclass, read_yaml_mapping
from artifacts.errors import ConfigError


@dataclass
class Inner:
    r: int = 8
    modules: list[str] = field(default_factory=lambda: ["q"])

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"r: must be > 0, got {self.r}")


@dataclass
class Outer:
    name: str = "x"
    lr: float = 1e-3
    enabled: bool = True
    limit: Optional[int] = None
    inner: Inner = field(default_factory=Inner)


def build(data: dict) -> Outer:
    return build_dataclass(Outer, data, key="", source=Path("recipe.yaml"))


def test_builds_nested_values_and_keeps_defaults() -> None:
    got = build({"lr": 1, "inner": {"modules": ["q", "v"]}, "limit": None})
    assert got == Outer(lr=1.0, inner=Inner(r=8, modules=["q", "v"]))
    assert isinstance(got.lr, float)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"nme": "x"}, "recipe.yaml: unknown key 'nme'"),
        ({"inner": {"rank": 4}}, "recipe.yaml: unknown key 'inner.rank'"),
        ({"inner": {"r": "eight"}}, "recipe.yaml: inner.r: expected an integer, got 'eight'"),
        ({"inner": {"r": 0}}, "recipe.yaml: inner: r: must be > 0, got 0"),
        ({"enabled": "yes"}, "recipe.yaml: enabled: expected true or false, got 'yes'"),
        ({"limit": 1.5}, "recipe.yaml: limit: expected an integer, got 1.5"),
        ({"inner": {"modules": "q"}}, "recipe.yaml: inner.modules: expected a list, got 'q'"),
        ({"inner": [1]}, "recipe.yaml: inner: expected a mapping, got a list"),
        ({"lr": True}, "recipe.yaml: lr: expected a number, got True"),
    ],
)
def test_rejects_with_file_and_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(data)
    assert str(info.value).startswith(message)


def test_read_yaml_mapping_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        read_yaml_mapping(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML \(line \d+\)"):
        read_yaml_mapping(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        read_yaml_mapping(scalar)
