"""A GPTQ checkpoint of a plain Hugging Face Llama dir by round-to-nearest, written in torch alone.

Why: the GPU check compares a GPTQ bundle's batch-1 decode with its bf16 parent on a random-init 1B Llama.
Real GPTQ needs gptqmodel, calibration data and minutes; the GPU machine has no gptqmodel and its time is
short. A decode step's speed depends on the layout and the bytes, not on how the codes were chosen, so this
writes round-to-nearest codes (``quantize.rtn.rtn_quantize``, symmetric, the grid GPTQ's quantizer uses) in the
exact layout gptqmodel 7.6 writes through ``quantize/backend.py``: GPTQ v1 (``checkpoint_format: gptq``), 4
bits, ``sym: true``, ``desc_act: false``, fp16 scales, zero points stored minus one, trivial ``g_idx``, every
projection of every decoder layer quantized and the output head left dense (gptqmodel's ``lm_head: false``).
``serving.engine.quantized_checkpoint`` reads it back exactly, and transformers + gptqmodel load it.

    python benchmarks/gptq_rtn.py MODEL_DIR OUT_DIR [--group-size 128]

On a GPU the rounding runs there (the 1B shape: a few seconds, most of it writing the file).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.common.atomic import staged_directory  # noqa: E402
from artifacts.safetensors_io import source_weight_files  # noqa: E402
from quantize.outputs import copy_sidecars  # noqa: E402
from quantize.rtn import rtn_quantize  # noqa: E402

log = logging.getLogger(__name__)

BITS = 4
PACK = 32 // BITS


def quantization_config(group_size: int) -> dict:
    """config.json's ``quantization_config`` as gptqmodel writes it for this recipe (the keys loaders read)."""
    return {"bits": BITS, "group_size": group_size, "desc_act": False, "sym": True, "lm_head": False,
            "quant_method": "gptq", "checkpoint_format": "gptq", "format": "gptq", "pack_dtype": "int32"}


def _pack_last(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 8W] -> int32 [..., W], element 8w + j in bits 4j of word w (little-endian bytes)."""
    v = values.to(torch.uint8).reshape(*values.shape[:-1], -1, PACK // 2, 2)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous().view(torch.int32).squeeze(-1)


def gptq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales`` and ``g_idx`` (CPU tensors) of one [out, in] weight, by RTN."""
    out_f, in_f = weight.shape
    if in_f % group_size or in_f % PACK or out_f % PACK:
        raise ValueError(f"a [{out_f}, {in_f}] weight does not pack into groups of {group_size} and words of "
                         f"{PACK} codes")
    q, scale, zero = rtn_quantize(weight, BITS, group_size, sym=True)  # [out, in], [out, G], [out, G] (zero 8)
    return {
        "qweight": _pack_last(q).T.contiguous().cpu(),  # [in/8, out]: packed along the inputs
        "qzeros": _pack_last((zero - 1).T).cpu(),  # v1 stores each zero point minus one
        "scales": scale.T.to(torch.float16).contiguous().cpu(),
        "g_idx": (torch.arange(in_f, dtype=torch.int32) // group_size),
    }


def _is_projection(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2


def write_rtn_gptq_checkpoint(model_dir: str | Path, out_dir: str | Path, group_size: int = 128,
                              device: str | torch.device | None = None) -> Path:
    """Write ``out_dir``: ``model_dir``'s tokenizer and config plus a GPTQ ``quantization_config``, and one
    model.safetensors with every decoder projection as RTN 4-bit codes and every other tensor as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(model_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src}: already quantized")
    files = source_weight_files(src)
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not _is_projection(name, tensor):
                    tensors[name] = tensor
                    continue
                prefix = name.removesuffix(".weight")
                for suffix, packed in gptq_tensors(tensor.to(device), group_size).items():
                    tensors[f"{prefix}.{suffix}"] = packed
                quantized += 1
    if not quantized:
        raise ValueError(f"{src}: no decoder projection (model.layers.*_proj.weight) to quantize")
    config["quantization_config"] = quantization_config(group_size)
    with staged_directory(out_dir) as tmp:
        copy_sidecars(src, tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n")
    log.info("gptq-rtn: %d projections of %s to 4 bits (group %d) in %s", quantized, src, group_size, out_dir)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_rtn_gptq_checkpoint(args.model_dir, args.out_dir, args.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
