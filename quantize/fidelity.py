"""How far a quantized model drifts from its full-precision reference, on held-out text.

Per candidate, over every next-token position of the texts:
- mean KL(ref || cand) of the next-token distributions (0 = identical behaviour),
- perplexity of the candidate on the actual next tokens,
- top-1 agreement (share of positions where both models' argmax tokens match),
- size on disk of the weight files.
All models run in fp32 so the numbers measure quantization, not dtype. The reference is re-run
beside each candidate (batch by batch) so only two models are ever in memory at once.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from artifacts.common.device import pick_device
from artifacts.common.mlflow_batch import log_batch
from artifacts.common.quiet import quiet_if_quantized
from artifacts.digests import digest_json
from quantize.backend import prepare_env
from quantize.errors import QuantizeError
from quantize.outputs import weights_size

log = logging.getLogger(__name__)

REFERENCE = "reference"


@dataclass
class FidelityRow:
    name: str
    path: str
    kl_mean: float
    perplexity: float
    top1_agreement: float
    size_bytes: int
    quantize_seconds: float | None = None


@dataclass
class FidelityReport:
    rows: list[FidelityRow]
    num_texts: int
    num_tokens: int
    texts_digest: str
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the markdown table

    def row(self, name: str) -> FidelityRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_markdown(self) -> str:
        ref_size = self.row(REFERENCE).size_bytes if any(r.name == REFERENCE for r in self.rows) else None
        timed = any(r.quantize_seconds is not None for r in self.rows)
        head = "| model | mean KL(ref‖q) | perplexity | top-1 agreement | size (MiB) | size vs ref |"
        rule = "|---|---:|---:|---:|---:|---:|"
        if timed:
            head, rule = head + " quantize (s) |", rule + "---:|"
        lines = [
            f"Fidelity vs full precision on {self.num_texts} held-out texts ({self.num_tokens} next-token positions).",
            "",
            head,
            rule,
        ]
        for r in self.rows:
            ratio = f"{r.size_bytes / ref_size:.2f}x" if ref_size else "-"
            line = (
                f"| {r.name} | {r.kl_mean:.3e} | {r.perplexity:.3f} | {r.top1_agreement:.4f} "
                f"| {r.size_bytes / 2**20:.2f} | {ratio} |"
            )
            if timed:
                line += f" {r.quantize_seconds:.1f} |" if r.quantize_seconds is not None else " - |"
            lines.append(line)
        if self.notes:
            lines += ["", *(f"- {note}" for note in self.notes)]
        return "\n".join(lines) + "\n"

    def log_to_mlflow(self, prefix: str = "fidelity") -> bool:
        """Log metrics (one batch) and the markdown/JSON artifacts into the active run, if any."""
        import mlflow

        run = mlflow.active_run()
        if run is None:
            return False
        log_batch(run.info.run_id, metrics={f"{prefix}.{r.name}.{key}": getattr(r, key) for r in self.rows
                                            for key in ("kl_mean", "perplexity", "top1_agreement", "size_bytes")})
        mlflow.log_text(self.to_markdown(), "quantize/fidelity.md")
        mlflow.log_text(self.to_json(), "quantize/fidelity.json")
        return True


def _load(model_dir: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    prepare_env()  # quantized checkpoints import gptqmodel through transformers
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if device != "cpu":
        kwargs["device_map"] = device
    try:
        with quiet_if_quantized(model_dir):
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError, ImportError) as err:
        raise QuantizeError(f"{model_dir}: cannot load for the fidelity report: {err}") from err
    return model.eval()


def _batches(tokenizer: Any, texts: Sequence[str], max_length: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches: with causal attention, real tokens never see the pads after them."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(
            list(texts[i : i + batch_size]), truncation=True, max_length=max_length, padding=True, return_tensors="pt"
        )
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


@torch.no_grad()
def _compare(
    ref: torch.nn.Module, cand: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: str, desc: str
) -> dict[str, float]:
    sums = {"kl": 0.0, "nll_ref": 0.0, "nll_cand": 0.0, "agree": 0.0, "n": 0}
    for batch in tqdm(batches, desc=desc, leave=False):
        ids = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        ref_lp = torch.log_softmax(ref(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
        cand_lp = torch.log_softmax(cand(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
        if ref_lp.shape != cand_lp.shape:
            raise QuantizeError(f"{desc}: logits shape {tuple(cand_lp.shape)} != reference {tuple(ref_lp.shape)}")
        valid = (mask[:, :-1] * mask[:, 1:]).bool()
        target = ids[:, 1:].unsqueeze(-1)
        kl = (ref_lp.exp() * (ref_lp - cand_lp)).sum(-1)
        sums["kl"] += kl[valid].sum().item()
        sums["nll_ref"] += -ref_lp.gather(-1, target).squeeze(-1)[valid].sum().item()
        sums["nll_cand"] += -cand_lp.gather(-1, target).squeeze(-1)[valid].sum().item()
        sums["agree"] += (ref_lp.argmax(-1) == cand_lp.argmax(-1))[valid].sum().item()
        sums["n"] += int(valid.sum().item())
    n = sums["n"]
    if n == 0:
        raise QuantizeError("fidelity texts: no text tokenizes to 2 or more tokens; nothing to compare")
    return {
        # KL can come out a hair below 0 from float rounding when the models agree exactly.
        "kl_mean": max(sums["kl"] / n, 0.0),
        "ppl_ref": math.exp(sums["nll_ref"] / n),
        "ppl_cand": math.exp(sums["nll_cand"] / n),
        "top1": sums["agree"] / n,
        "n": n,
    }


def fidelity_report(
    reference_dir: Path,
    candidates: dict[str, Path],
    texts: Sequence[str],
    *,
    max_length: int = 256,
    batch_size: int = 8,
    device: str | None = None,
    log_to_mlflow: bool = True,
) -> FidelityReport:
    """Compare each candidate model dir with the full-precision `reference_dir` on `texts`."""
    from transformers import AutoTokenizer

    if not texts:
        raise QuantizeError("fidelity texts: empty; need held-out text to compare on")
    if REFERENCE in candidates:
        raise QuantizeError(f"candidates: the name {REFERENCE!r} is reserved for the full-precision row")
    device = device or pick_device().type
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    batches = _batches(tokenizer, texts, max_length, batch_size)
    ref = _load(Path(reference_dir), device)
    rows: list[FidelityRow] = []
    ref_ppl: float | None = None
    num_tokens = 0
    for name, path in candidates.items():
        cand = _load(Path(path), device)
        stats = _compare(ref, cand, batches, device, f"fidelity {name}")
        del cand
        ref_ppl, num_tokens = stats["ppl_ref"], stats["n"]
        rows.append(
            FidelityRow(name, str(path), stats["kl_mean"], stats["ppl_cand"], stats["top1"], weights_size(Path(path)))
        )
        log.info("fidelity %s: KL %.3e, ppl %.3f, top-1 %.4f", name, stats["kl_mean"], stats["ppl_cand"], stats["top1"])
    if ref_ppl is None:  # no candidates: the reference against itself still gives its perplexity
        stats = _compare(ref, ref, batches, device, "fidelity reference")
        ref_ppl, num_tokens = stats["ppl_ref"], stats["n"]
    rows.insert(0, FidelityRow(REFERENCE, str(reference_dir), 0.0, ref_ppl, 1.0, weights_size(Path(reference_dir))))
    report = FidelityReport(rows=rows, num_texts=len(texts), num_tokens=num_tokens,
                            texts_digest=digest_json(list(texts)))
    if log_to_mlflow:
        report.log_to_mlflow()
    return report
