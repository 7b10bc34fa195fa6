"""Building the C++ extensions (serving/engine/cpp_build.py): the build cache is keyed by the source, so a changed
.cpp builds afresh, and a source that is not there leaves the torch path instead of failing."""

from __future__ import annotations

from serving.engine import cpp_build


def test_the_cache_key_follows_the_source(tmp_path):
    a, b, c = tmp_path / "a.cpp", tmp_path / "b.cpp", tmp_path / "c.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 1; }\n")
    c.write_text("int f() { return 2; }\n")
    assert cpp_build.build_tag(a) == cpp_build.build_tag(b) != cpp_build.build_tag(c)


def test_every_extension_source_ships_in_csrc():
    assert {p.name for p in cpp_build.CSRC.glob("*.cpp")} >= {"cpu_kernels.cpp", "int4_linear.cpp"}


def test_a_missing_source_means_torch_path(monkeypatch, tmp_path):
    monkeypatch.delenv(cpp_build.ENV_SWITCH, raising=False)
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: "/usr/bin/c++")
    assert cpp_build.build("llm_lifecycle_missing", tmp_path / "missing.cpp") is None
