"""Building the C++ extensions (serving/engine/cpp_build.py): one translation unit each, and the build cache keyed
by every file of the extension, what the unit includes too, so a changed .cpp or .h builds afresh, and a file that
is not there leaves the torch path instead of failing; a build killed mid-compile does not block the next one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from serving.engine import cpp_build, cpu_kernels


def test_the_cache_key_follows_the_source_and_where_it_lives(tmp_path):
    """Other bytes build afresh; so do the same bytes in another checkout (ninja's build file names each source by
    its absolute path: two checkouts sharing one key rebuilt it over each other on every load)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 1; }\n")
    tag = cpp_build.build_tag([a])
    assert cpp_build.build_tag([a]) == tag != cpp_build.build_tag([b])
    a.write_text("int f() { return 2; }\n")
    assert cpp_build.build_tag([a]) != tag


def test_the_cache_key_follows_the_torch_installation(tmp_path, monkeypatch):
    """Two virtual environments on one host share ~/.cache/torch_extensions; ninja's build file names each
    one's torch include paths, so one shared key made them recompile over each other on every load (seen:
    replicas waiting minutes on the build lock). A second torch install is planted by moving torch's path."""
    import torch

    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    tag = cpp_build.build_tag([source])
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpp_build.build_tag([source]) != tag


def test_the_cache_key_follows_every_file_headers_included(tmp_path):
    src, other, header = tmp_path / "k.cpp", tmp_path / "m.cpp", tmp_path / "k.h"
    src.write_text('#include "k.h"\nint f() { return g(); }\n')
    other.write_text("int h() { return 3; }\n")
    header.write_text("inline int g() { return 1; }\n")
    files = [src, other, header]
    tag = cpp_build.build_tag(files)
    header.write_text("inline int g() { return 2; }\n")
    assert cpp_build.build_tag(files) != tag
    header.write_text("inline int g() { return 1; }\n")
    assert cpp_build.build_tag(files) == tag
    other.write_text("int h() { return 4; }\n")
    assert cpp_build.build_tag(files) != tag


def test_every_extension_file_ships_in_csrc():
    """Every .cpp and .h in csrc belongs to an extension's file list, so it is hashed into the cache key."""
    int4 = cpp_build.CSRC / "int4_linear.cpp"
    kernels = (cpu_kernels.SOURCE, *cpu_kernels.INCLUDES)
    assert all(f.is_file() for f in (*kernels, int4))
    assert {f.suffix for f in cpu_kernels.INCLUDES} == {".cpp", ".h"}
    assert {*cpp_build.CSRC.glob("*.cpp"), *cpp_build.CSRC.glob("*.h")} == {*kernels, int4}
    # the one translation unit includes every kernel source (each compiled alone would parse torch's headers again)
    unit = cpu_kernels.SOURCE.read_text()
    assert all(f'#include "{f.name}"' in unit for f in cpu_kernels.INCLUDES if f.suffix == ".cpp")


@pytest.mark.parametrize("missing", ["missing.cpp", "missing.h"])
def test_a_missing_file_means_torch_path(monkeypatch, tmp_path, missing):
    monkeypatch.delenv(cpp_build.ENV_SWITCH, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: "/usr/bin/c++")
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda name, sources, **flags: builds.append(sources) or object())
    present, header = tmp_path / "k.cpp", tmp_path / "k.h"
    present.write_text('#include "k.h"\nint f() { return g(); }\n')
    header.write_text("inline int g() { return 1; }\n")
    assert cpp_build.build("llm_lifecycle_missing", present, [header, tmp_path / missing]) is None
    assert builds == []  # nothing compiled
    assert cpp_build.build("llm_lifecycle_present", present, [header]) is not None
    assert builds == [[str(present)]]  # the one unit is compiled, what it includes only hashed


TINY_EXTENSION = Path(__file__).with_name("csrc") / "tiny_extension.cpp"


@pytest.mark.timeout(600)  # the fault this guards against is a wait with no end
def test_a_build_killed_mid_compile_does_not_block_the_next(monkeypatch, tmp_path):
    """A builder killed mid-compile leaves torch's ``lock`` file in the build directory (planted here, as such a
    kill would); the next build must clear it and compile, not wait on it forever as torch's ``load`` does."""
    monkeypatch.delenv(cpp_build.ENV_SWITCH, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "tiny.cpp"
    shutil.copy(TINY_EXTENSION, source)
    name = "llm_lifecycle_tiny"
    build_dir = tmp_path / "extensions" / f"{name}_{cpp_build.build_tag([source])}"
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    module = cpp_build.build(name, source)
    assert module is not None and module.answer() == 42
    assert not (build_dir / "lock").exists()


def test_the_cache_key_follows_the_extra_compiler_flags(tmp_path, monkeypatch):
    """``LLM_LIFECYCLE_CPU_KERNELS_FLAGS=-mno-avx512f`` builds other code from the same files (the AVX2 kernels on an
    AVX-512 host): it must not be handed the cached native build, nor overwrite it."""
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.delenv(cpp_build.FLAGS_ENV, raising=False)
    tag = cpp_build.build_tag([source])
    monkeypatch.setenv(cpp_build.FLAGS_ENV, "-mno-avx512f")
    assert cpp_build.extra_flags() == ["-mno-avx512f"]
    assert cpp_build.build_tag([source]) != tag


def test_a_bad_extra_flag_leaves_the_torch_path_with_the_compilers_reason(tmp_path, monkeypatch, caplog):
    """A flag the compiler rejects fails the build (the torch ops run instead), and the warnings say why, in the
    compiler's words, and which setting put the flag there, not just the command line that failed."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(cpp_build.FLAGS_ENV, "-mno-such-flag-anywhere")
    with caplog.at_level("WARNING", logger="serving.engine.cpp_build"):
        assert cpp_build.build("flag_check", source) is None
    text = caplog.text
    assert "error:" in text and "-mno-such-flag-anywhere" in text
    assert f"{cpp_build.FLAGS_ENV}=-mno-such-flag-anywhere was added to the build" in text
