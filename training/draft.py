"""A draft model for speculative decoding, built from its target: the first layers, distilled.

Why: the server's draft-model speculation (`serving/engine/draft_model.py`) keeps a guessed token only where
it equals the target's greedy one, so a draft pays by how often its argmax agrees with the target's, and it
must share the target's tokenizer id for id. A layer-truncated copy of the target (its embeddings, first N
decoder layers, final norm and lm_head) shares the vocabulary by construction and already agrees often; a
short knowledge distillation (`training.distill`) on the text the target learned from teaches the kept layers
to stand in for the cut ones. Agreement on held-out text, before and after, says what the distillation bought.

The output is an ordinary Hugging Face directory (safetensors, config.json with the new
``num_hidden_layers``), the target's tokenizer files, chat template and generation config copied byte for
byte, and ``draft.json`` (recipe, target digest, agreement before/after). It is written to a staging
directory and renamed into place, so a crash never leaves half a draft under the output's name.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from artifacts.common.atomic import staged_directory
from artifacts.common.device import pick_device
from artifacts.digests import digest_json, sha256_file
from artifacts.model_spec import SUPPORTED_MODEL_TYPES
from artifacts.tokenizer_files import TOKENIZER_FILES
from training.base_model import RECIPE_FILE, BaseModelConfig, BaseModelError, validate_model_dir
from training.distill import distill, measure_agreement
from training.draft_config import DraftConfig, DraftError
from training.ranks import cuda_device_index, is_main_process, is_worker

DRAFT_RECORD = "draft.json"
# Copied verbatim from the target: the engine refuses a draft whose tokenizer maps any token to another id.
CARRIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
# Config fields that hold one entry per decoder layer and must be cut with the layers.
_PER_LAYER_FIELDS = ("layer_types",)


@dataclass
class DraftBuild:
    """What `build_draft` made: where, how big next to its target, and how often it agrees with it."""

    path: Path
    target: Path
    layers: int
    target_layers: int
    draft_params: int
    target_params: int
    steps: int
    seconds: float
    final_loss: float | None  # the distillation KL over the last steps; None without distillation
    agreement_before: float  # the plain truncated copy, on the held-out tokens
    agreement: float  # after distillation: the share of held-out positions whose argmax equals the target's
    heldout_tokens: int
    text_source: str

    def metrics(self) -> dict[str, float]:
        out = {"agreement_before": self.agreement_before, "agreement_after": self.agreement,
               "draft_seconds": self.seconds, "draft_params": float(self.draft_params),
               "target_params": float(self.target_params)}
        if self.final_loss is not None:
            out["distill_final_loss"] = self.final_loss
        return out


def build_draft(target_dir: str | Path, out_dir: str | Path, config: DraftConfig | None = None,
                texts: Sequence[str] | None = None, *, overwrite: bool = False) -> DraftBuild:
    """Write a distilled ``config.layers``-layer draft of ``target_dir`` into ``out_dir``.

    ``texts``: the documents to distill on (a held-out share of them measures agreement); by default the
    embedded synthetic corpus, with the target's own recipe when it is an embedded base model. Every input
    is checked before anything is loaded or written; ``overwrite`` replaces an existing ``out_dir``."""
    config = config or DraftConfig()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_config = check_target(target_dir, config)
    _check_output(out_dir, target_dir, overwrite)
    if texts is None:
        texts, source = corpus_texts(target_dir)
    else:
        texts = list(texts)
        source = f"{len(texts)} documents from the caller"
    if config.distributed.enabled and not is_worker():
        return _build_in_workers(target_dir, out_dir, config, texts, source)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    with _torch_threads(config.threads):
        torch.manual_seed(config.seed)
        train, heldout = split_tokens(AutoTokenizer.from_pretrained(str(target_dir)), texts, config)
        device = pick_device(config.device)
        if is_worker() and device.type == "cuda":  # one process per GPU
            device = torch.device("cuda", cuda_device_index())
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
        target.requires_grad_(False)
        draft = truncated_copy(target, config.layers)
        before = measure_agreement(target, draft, heldout, config.batch_size)
        log = distill(target, draft, train, config, device) if config.steps else None
        after = measure_agreement(target, draft, heldout, config.batch_size) if log else before
        build = DraftBuild(
            path=out_dir, target=target_dir, layers=config.layers,
            target_layers=target.config.num_hidden_layers,
            draft_params=sum(p.numel() for p in draft.parameters()),
            target_params=sum(p.numel() for p in target.parameters()),
            steps=config.steps, seconds=0.0, final_loss=log["loss"][-1] if log else None,
            agreement_before=before.rate, agreement=after.rate, heldout_tokens=after.positions,
            text_source=source)
        if not is_main_process():  # rank 0 alone writes the draft
            return build
        with staged_directory(out_dir, if_exists="replace") as tmp:
            draft.to("cpu").to(_saved_dtype(target_config)).save_pretrained(str(tmp))
            for name in CARRIED_FILES:
                if (target_dir / name).is_file():
                    shutil.copy2(target_dir / name, tmp / name)
            build.seconds = time.perf_counter() - started
            record = {"recipe": config.recipe(), "target": {"path": str(target_dir),
                                                            "weights_digest": weights_digest(target_dir)},
                      "build": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(build).items()},
                      "heldout_kl_before": before.kl, "heldout_kl_after": after.kl,
                      "train_tokens": len(train), "distillation": log}
            (tmp / DRAFT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return build


def _build_in_workers(target_dir: Path, out_dir: Path, config: DraftConfig, texts: list[str],
                      source: str) -> DraftBuild:
    """Distill in `config.distributed.num_processes` workers (training.launcher), each running `build_draft` as
    its rank; rank 0 writes the draft, whose record this reads back. The job and the ranks' logs live beside
    the output (the output itself is replaced whole when it is written)."""
    from training.launcher import launch_workers

    work_dir = out_dir.parent / f".{out_dir.name}.workers"
    work_dir.mkdir(parents=True, exist_ok=True)
    texts_file = work_dir / "texts.json"
    texts_file.write_text(json.dumps(texts), encoding="utf-8")
    job = {"kind": "draft", "target_dir": str(target_dir), "out_dir": str(out_dir), "config": asdict(config),
           "texts_file": str(texts_file), "overwrite": True}  # the inputs and the output were checked here
    launch_workers(job, config.distributed, pick_device(config.device).type, work_dir, "draft")
    built = json.loads((out_dir / DRAFT_RECORD).read_text(encoding="utf-8"))["build"]
    return DraftBuild(**{**built, "path": Path(built["path"]), "target": Path(built["target"]),
                         "text_source": source})


# --- inputs ------------------------------------------------------------------------------------------------

def check_target(target_dir: Path, config: DraftConfig) -> dict[str, Any]:
    """The target's config.json, once it is known to be a full-precision Llama-layout model with more layers
    than the draft keeps and a context that holds ``config.seq_len``; else DraftError."""
    try:
        validate_model_dir(target_dir, what="draft target")
    except BaseModelError as exc:
        raise DraftError(str(exc)) from None
    raw = json.loads((target_dir / "config.json").read_text())
    where = f"draft target {target_dir}"
    if raw["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise DraftError(f"{where}: model_type {raw['model_type']!r} cannot be cut into a draft; layer truncation "
                         f"knows the Llama layout ({', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "quantized")
        raise DraftError(f"{where}: a {method} checkpoint; build the draft from the full-precision model it was "
                         "quantized from (the draft serves beside either)")
    layers = raw.get("num_hidden_layers")
    if not isinstance(layers, int) or config.layers >= layers:
        raise DraftError(f"{where}: layers {config.layers}: the target has {layers} decoder layers; a draft keeps "
                         f"fewer (1 to {layers - 1 if isinstance(layers, int) else '?'})")
    context = raw.get("max_position_embeddings")
    if isinstance(context, int) and config.seq_len > context:
        raise DraftError(f"{where}: seq_len {config.seq_len} exceeds the target's context "
                         f"(max_position_embeddings {context})")
    return raw


def _check_output(out_dir: Path, target_dir: Path, overwrite: bool) -> None:
    out, target = out_dir.resolve(), target_dir.resolve()
    if out == target or out in target.parents:
        raise DraftError(f"output {out_dir}: would replace the target {target_dir}; choose another directory")
    if out_dir.exists() and not overwrite:
        raise DraftError(f"output {out_dir}: already exists; remove it or pass --force to replace it")


def corpus_texts(target_dir: Path) -> tuple[list[str], str]:
    """The embedded synthetic pretraining corpus (documents, where they came from): the target's own recipe
    when it is an embedded base model (its recipe.json), else the default preset's."""
    from training.corpus import build_corpus

    try:
        saved = json.loads((target_dir / RECIPE_FILE).read_text())
        known = {f.name for f in fields(BaseModelConfig)}
        base = BaseModelConfig(preset=saved["preset"], **{k: v for k, v in saved["recipe"].items() if k in known})
        source = f"embedded corpus ({base.preset} recipe in the target's {RECIPE_FILE})"
    except (OSError, ValueError, KeyError, TypeError):
        base = BaseModelConfig()
        source = "embedded corpus (default preset)"
    return build_corpus(base.corpus_spec()), source


def data_stage_texts(data_dir: Path) -> list[str]:
    """The data stage's SFT chats, rendered as the calibration set renders them: training text for a draft of a
    model that did not come from the embedded corpus."""
    from artifacts.jsonl import iter_jsonl
    from training.tokenizer import render_chat

    path = Path(data_dir) / "sft_train.jsonl"
    return [render_chat(record["messages"]) for _, record in iter_jsonl(path, DraftError)]


def split_tokens(tokenizer: Any, texts: Sequence[str], config: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed training stream, held-out windows [n, length]) from ``texts``.

    Whole documents are held out (from a seeded shuffle, until ``eval_tokens`` or half the documents), after
    dropping repeats, so no held-out document is also trained on."""
    docs = list(dict.fromkeys(t for t in texts if t))
    random.Random(config.seed).shuffle(docs)
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    held, held_tokens = 0, 0
    while held < len(ids) // 2 and held_tokens < config.eval_tokens:
        held += 1
        held_tokens += len(ids[-held])
    train = torch.tensor([i for doc in ids[:len(ids) - held] for i in doc], dtype=torch.long)
    heldout = [i for doc in ids[len(ids) - held:] for i in doc][:config.eval_tokens]
    if len(train) < config.seq_len + 1 or len(heldout) < 2:
        raise DraftError(f"texts: {len(docs)} distinct documents give {len(train)} training and {len(heldout)} "
                         f"held-out tokens; distillation needs more than seq_len ({config.seq_len}) to train on "
                         "and at least 2 to measure agreement on")
    length = min(config.seq_len, len(heldout))
    windows = torch.tensor(heldout[:len(heldout) // length * length], dtype=torch.long).view(-1, length)
    return train, windows


# --- the model -----------------------------------------------------------------------------------------------

def truncated_copy(target: Any, layers: int) -> Any:
    """A new model of the target's class with its embeddings, first ``layers`` decoder layers, final norm and
    lm_head (weights copied, so a tied lm_head stays tied), and a config that says ``layers``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    total = config.num_hidden_layers
    config.num_hidden_layers = layers
    for name in _PER_LAYER_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) == total:
            setattr(config, name, value[:layers])
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kept = {name: tensor for name, tensor in target.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    draft.load_state_dict(kept, strict=True)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(next(target.parameters()).device)


def _saved_dtype(target_config: dict[str, Any]) -> torch.dtype:
    """The target's stored dtype (float32, bfloat16 or float16), so the draft loads as the target does."""
    name = target_config.get("dtype") or target_config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def weights_digest(model_dir: Path) -> str:
    """sha256 over the target's weight files: which target a draft was distilled from."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    return digest_json({p.name: sha256_file(p) for p in files})


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
