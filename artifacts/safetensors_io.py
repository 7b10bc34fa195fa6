"""Reading safetensors headers without loading tensors, and locating a model dir's weight files.

Why our own header reader: the verifier must check shapes, dtypes and that a file is complete for
multi-GB shards in milliseconds. The format is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets) and the raw data, so a truncated file is caught by comparing the
offsets the header declares with the file's size, before anything is memory-mapped.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from artifacts.errors import BundleError, BundleVerificationError

DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# config.json's dtype names -> safetensors dtype names
CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}

_MAX_HEADER = 100 * 1024 * 1024


@dataclass
class HeaderTensor:
    dtype: str
    shape: list[int]
    begin: int
    end: int


def read_header(path: Path, label: str | None = None) -> dict[str, HeaderTensor]:
    """Parse and sanity-check a safetensors header; raise `BundleVerificationError(label, reason)`."""
    label = label or path.name
    size = path.stat().st_size
    if size < 8:
        raise BundleVerificationError(label, f"truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise BundleVerificationError(
                label, f"truncated safetensors file (header declares {header_len} bytes, file has {size})"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleVerificationError(label, f"corrupt safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    tensors: dict[str, HeaderTensor] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleVerificationError(label, f"corrupt header entry for tensor {name}") from exc
        if dtype not in DTYPE_BYTES:
            raise BundleVerificationError(label, f"tensor {name} has unknown dtype {dtype}")
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != expected:
            raise BundleVerificationError(
                label, f"tensor {name} spans {end - begin} bytes but {dtype}{shape} needs {expected}"
            )
        tensors[name] = HeaderTensor(dtype, shape, begin, end)
        data_end = max(data_end, end)
    available = size - 8 - header_len
    if available < data_end:
        raise BundleVerificationError(
            label, f"truncated safetensors file (header declares {data_end} data bytes, file has {available})"
        )
    if available > data_end:
        raise BundleVerificationError(label, f"{available - data_end} trailing bytes after the tensor data")
    return tensors


def source_weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor of a HF model dir to the safetensors file holding it (single file or index)."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise BundleError(f"{index}: not a valid safetensors index ({exc})") from exc
        result = {}
        for tensor, shard in weight_map.items():
            path = model_dir / shard
            if not path.is_file():
                raise BundleError(f"{index}: shard {shard} (tensor {tensor}) does not exist")
            result[tensor] = path
        return result
    if single.is_file():
        return {name: single for name in read_header(single, str(single))}
    raise BundleError(f"{model_dir}: no model.safetensors or model.safetensors.index.json (only safetensors "
                      "checkpoints can be bundled)")
