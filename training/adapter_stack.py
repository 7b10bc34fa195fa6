"""Stack the LoRA adapters of consecutive stages (SFT, then DPO, then GRPO) into one adapter of the first base.

Each stage trains an adapter on the merged output of the one before and merges it: the last model is
``W + s₁B₁A₁ + s₂B₂A₂ + …`` for every targeted projection, a sum of low-rank terms. One adapter of rank
``r₁ + r₂ + …`` with ``A = [A₁; A₂; …]`` and ``B = [s₁B₁, s₂B₂, …]`` adds exactly that sum to the first base, so
the stacked adapter served on the base answers as the merged model does (to float rounding). Why stack rather
than fold the terms into one adapter of the first stage's rank by SVD: the SVD would be a lossy approximation of
what the evals measured, where stacking is the trained model itself; the price is rank (3 × 16 = 48 for three
rank-16 stages), which ``--max-lora-rank`` must allow.

The scaling of each stage (``lora_alpha / r``, or ``/ √r`` with rsLoRA) is folded into its B, and the stacked
adapter says ``lora_alpha = r`` (scaling 1). A projection one stage does not target gets zero rows in A and zero
columns in B for that stage's share of the rank.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from artifacts.common.atomic import staged_directory
from training.stage_config import TrainingError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
STACK_RECORD = "stacked_from.json"
_KEY = re.compile(r"^(?P<prefix>.*layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_(?P<which>[AB])\.weight$")


def _read(adapter_dir: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).is_file():
            raise TrainingError(f"{adapter_dir / name}: missing (a PEFT adapter saved as safetensors is needed)")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise TrainingError(f"{adapter_dir / ADAPTER_CONFIG}: DoRA and per-module ranks cannot be stacked")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter_dir / ADAPTER_WEIGHTS)).items():
        m = _KEY.match(key)
        if m is None:
            raise TrainingError(f"{adapter_dir / ADAPTER_WEIGHTS}: {key!r} is not a LoRA weight of a projection")
        modules.setdefault(m.group("prefix"), {})[m.group("which")] = tensor.to(torch.float32)
    return config, modules


def _scaling(config: dict) -> float:
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def stack_adapters(adapter_dirs: list[Path], output_dir: Path) -> Path:
    """One adapter equal to applying ``adapter_dirs`` in turn, each merged before the next was trained (see the
    module docstring); written to ``output_dir`` in whole or not at all."""
    from safetensors.torch import save_file

    if not adapter_dirs:
        raise TrainingError("stack_adapters: no adapters to stack")
    read = [_read(Path(d)) for d in adapter_dirs]
    ranks = [int(config["r"]) for config, _ in read]
    total = sum(ranks)
    prefixes = sorted({p for _, modules in read for p in modules})
    stacked: dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        shapes = [(m[prefix]["B"].shape[0], m[prefix]["A"].shape[1]) for _, m in read if prefix in m]
        if len(set(shapes)) != 1:
            raise TrainingError(f"{prefix}: the stages' adapters disagree on its shape ({sorted(set(shapes))})")
        out, inp = shapes[0]
        a_parts, b_parts = [], []
        for (config, modules), r in zip(read, ranks, strict=True):
            pair = modules.get(prefix)
            if pair is None:
                a_parts.append(torch.zeros(r, inp))
                b_parts.append(torch.zeros(out, r))
            else:
                a_parts.append(pair["A"])
                b_parts.append(pair["B"] * _scaling(config))
        stacked[f"{prefix}.lora_A.weight"] = torch.cat(a_parts).contiguous()
        stacked[f"{prefix}.lora_B.weight"] = torch.cat(b_parts, dim=1).contiguous()
    first = read[0][0]
    targets = sorted({t for config, _ in read for t in (config.get("target_modules") or [])})
    config = {**{k: first[k] for k in ("base_model_name_or_path", "task_type", "peft_type") if k in first},
              "r": total, "lora_alpha": total, "use_rslora": False, "lora_dropout": 0.0, "bias": "none",
              "target_modules": targets, "fan_in_fan_out": False, "use_dora": False}
    # what it was stacked from goes beside the config, not in it: PEFT warns on every key its LoraConfig lacks
    provenance = {"stacked_from": [str(d) for d in adapter_dirs], "ranks": ranks}
    with staged_directory(Path(output_dir), if_exists="replace") as tmp:
        save_file(stacked, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / STACK_RECORD).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    return Path(output_dir)
