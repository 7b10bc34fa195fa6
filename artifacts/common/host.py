"""Facts about the host read from /proc/cpuinfo (the CPU's vendor and model name), for choices and records."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo (``vendor_id``, ``model name``); "" where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
