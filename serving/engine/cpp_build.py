"""Compile one of the engine's C++ extensions (``serving/engine/csrc/``) for this CPU, or say it cannot be.

``build`` runs ``torch.utils.cpp_extension.load`` on the extension's one .cpp unit (cached under
``~/.cache/torch_extensions``, about 30 s the first time; flags include ``-march=native``) when a C++ compiler is
present. The extension's name, and so its cache directory, carries a hash of this CPU's feature flags, of the
torch installation it builds against, and of every file of the extension, its headers included: a cache shared
between hosts never hands one host's binary to another, two environments on one host do not rebuild over each
other, and a changed .cpp or .h builds afresh. ``build`` returns None, and the caller keeps its torch
path, when a file is missing, there is no compiler, the build fails, or ``LLM_LIFECYCLE_CPU_KERNELS=0``.

Builds are serialised by an ``flock`` on ``<build dir>.flock``, which the kernel releases when its holder dies.
torch's own guard is a ``lock`` file in the build directory that a builder killed mid-compile (a restart, an
OOM kill, a CI timeout) leaves behind, and every later ``load`` then waits on it forever: that hung a whole CI
run at test collection. Holding our flock proves no live builder of ours owns such a file, so it is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

ENV_SWITCH = "LLM_LIFECYCLE_CPU_KERNELS"  # "0" keeps the pure-torch ops
FLAGS_ENV = "LLM_LIFECYCLE_CPU_KERNELS_FLAGS"  # extra compiler flags, e.g. "-mno-avx512f"
CSRC = Path(__file__).with_name("csrc")


def _cpu_flags() -> str:
    """This CPU's feature flags: the build uses -march=native, so the binary is only good for this flag set."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags or platform.processor() or platform.machine()


def _torch_install() -> str:
    """Which torch the extension is compiled against (its version and where it is installed): ninja's build
    file names torch's include directories by path, so two environments sharing one cache directory would
    each find the other's build file stale and recompile the extension, under the lock, on every load."""
    import torch

    return f"{torch.__version__}\0{Path(torch.__file__).parent}"


def extra_flags() -> list[str]:
    """The compiler flags ``LLM_LIFECYCLE_CPU_KERNELS_FLAGS`` adds (split as a shell would)."""
    return shlex.split(os.environ.get(FLAGS_ENV, ""))


def build_tag(files: Sequence[Path]) -> str:
    """Short hash of this CPU's flags, the torch it builds against, and each file's path and bytes: the build
    cache key besides the extension's name. The path, because ninja's build file names the sources by absolute
    path: two checkouts sharing one environment (a `git worktree` beside the main one) otherwise shared one build
    directory and rebuilt it, under the lock, each time the other one loaded (~90 s of compile on 2 cores,
    seen as replicas taking 100 s to start in `benchmarks/serve_start.py --tree`)."""
    digest = hashlib.sha1(_cpu_flags().encode() + b"\0" + _torch_install().encode()
                          + b"\0" + " ".join(extra_flags()).encode())
    for f in files:
        digest.update(b"\0" + str(Path(f).resolve()).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:10]


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (waiting for a live builder to finish), with any ``lock`` file a dead
    builder left there removed: only a holder of this flock creates one, and the flock died with its holder."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".flock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that died mid-compile", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(name: str, source: Path, includes: Sequence[Path] = ()) -> ModuleType | None:
    """Compile the extension whose one translation unit is ``source`` (``includes``: every file it includes,
    hashed into the cache key, not compiled) for this CPU, cached per CPU-flag set and file contents; or None when
    it cannot be built here: a file is missing, no compiler, a failed build, or ``LLM_LIFECYCLE_CPU_KERNELS=0``.
    Callers keep their torch path on None.

    One translation unit, because parsing torch's headers is most of a compile: the CPU kernels as four units
    took 131 s of CPU on a 2-vCPU AMD EPYC host, as one 42 s."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU kernels (%s) disabled by %s=0", name, ENV_SWITCH)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("no C++ compiler: %s unavailable, torch ops are used", name)
        return None
    files = [source, *includes]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        log.warning("CPU kernels %s: %s missing (an install without package data?); torch ops are used", name,
                    ", ".join(missing))
        return None
    tag = build_tag(files)
    from torch.utils.cpp_extension import _get_build_directory, load

    # -fopenmp: at::parallel_for splits work over threads only when the extension itself is built with OpenMP
    # (without it the pragma inside ATen's header is ignored and every kernel runs on one thread); the extension
    # then binds to the libgomp torch already loaded, so both share one thread pool. A compiler without OpenMP
    # still gets the kernels, single-threaded.
    attempts = [("", ["-fopenmp"], ["-fopenmp"]), ("_serial", ["-fopenmp-simd"], [])]
    for suffix, cflags, ldflags in attempts:
        module_name = f"{name}_{tag}{suffix}"
        build_dir = Path(_get_build_directory(module_name, False))  # $TORCH_EXTENSIONS_DIR or torch's default
        try:
            with exclusive_build(build_dir):
                module = load(module_name, sources=[str(source)], build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native", *extra_flags(), *cflags],
                              extra_ldflags=ldflags)
        except Exception as e:  # any build or load failure: try the next flags, then the torch path
            log.warning("CPU kernels %s did not build with %s (%s: %s)", name, " ".join(cflags),
                        type(e).__name__, _compiler_error(str(e)))
            continue
        if suffix:
            log.warning("CPU kernels %s built without OpenMP: they run on one thread", name)
        return module
    added = f" ({FLAGS_ENV}={' '.join(extra_flags())} was added to the build: check it)" if extra_flags() else ""
    log.warning("CPU kernels %s unavailable; torch ops are used%s", name, added)
    return None


def _compiler_error(message: str) -> str:
    """The compiler's first ``error:`` line of a failed build's output, else the output's first line: the first line
    alone is the command that failed, which says nothing of why."""
    lines = message.splitlines()
    return next((line.strip() for line in lines if "error:" in line), lines[0] if lines else "")
