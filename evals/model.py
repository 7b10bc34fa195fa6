"""Loading any Hugging Face causal-LM directory for in-process evaluation.

Works for the embedded tiny model, a user's local Llama/Qwen dir and quantized bundles that
transformers loads. Everything model-specific the suites need (chat template, stop ids, context
length, device) is resolved here once, so suites never guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from artifacts.common.device import pick_device
from artifacts.common.quiet import quiet_if_quantized
from artifacts.common.stop_tokens import stop_token_ids
from evals.errors import EvalError

log = logging.getLogger(__name__)

_DEFAULT_MAX_CONTEXT = 2048


@dataclass
class LoadedModel:
    """A model ready for evaluation and the facts about it the suites rely on."""

    model_dir: Path
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    device: torch.device
    eos_ids: list[int]
    pad_id: int
    max_context: int
    # who writes the generation suites' replies (evals.engine_generation): "transformers" (this model's own
    # `generate`), "engine" (our serving engine over model_dir) or "auto" (the engine where it loads the model)
    generation_backend: str = "transformers"
    adapter_dir: Path | None = None  # the LoRA adapter applied on the model, which the engine puts in a slot
    engine: Any = None  # the EngineGenerator, started on the first generation
    engine_refusal: str | None = None  # why the engine could not load the model (auto: transformers instead)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's own chat template applied to ``messages``, ready for the assistant's turn."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        """The whole conversation rendered by the chat template (no generation prompt)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of already-templated text: the template supplies any bos itself."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The server's stop ids (see artifacts.common.stop_tokens); evals cannot score a model that has none."""
    ids = stop_token_ids(model_dir, tokenizer)
    if not ids:
        raise EvalError(f"{model_dir}: no eos token id in generation_config.json or the tokenizer")
    return ids


def _max_context(model: Any, tokenizer: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        return tok_max
    return _DEFAULT_MAX_CONTEXT


def load_model(model_dir: str | Path, device: str | None = None, adapter: str | Path | None = None,
               generation_backend: str = "auto") -> LoadedModel:
    """Load tokenizer and model from ``model_dir``; fp32 on CPU, the checkpoint's dtype on CUDA.

    ``adapter``: a LoRA adapter directory (an adapter bundle or a plain PEFT adapter) applied on the model unmerged,
    as a server's adapter slot applies it: what the adapter release form ships is evaluated as it is served.
    ``generation_backend``: who generates replies (``LoadedModel.generation_backend``; the engine starts lazily).

    Raises EvalError if the directory is missing, is not a causal LM, or its tokenizer has no chat
    template (the task suites must prompt the model the way it was trained to be prompted).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EvalError(f"{model_dir}: model dir not found")
    if not (model_dir / "config.json").is_file():
        raise EvalError(f"{model_dir}: not a Hugging Face model dir (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise EvalError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise EvalError(f"{model_dir}: the tokenizer has no chat_template; evals prompt the model with "
                        "its own chat template (add one to tokenizer_config.json)")

    dev = pick_device(device)
    dtype: Any = torch.float32 if dev.type == "cpu" else "auto"
    try:
        with quiet_if_quantized(model_dir):
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except (OSError, ValueError) as exc:
        raise EvalError(f"{model_dir}: cannot load the model ({exc})") from exc
    if adapter is not None:
        model = _with_adapter(model, Path(adapter))
    if getattr(model, "hf_device_map", None) is None:
        model.to(dev)
    else:  # placed by its quantization library: feed inputs where the embeddings live
        dev = torch.device(model.device)
    model.eval()

    eos_ids = _eos_ids(model_dir, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return LoadedModel(model_dir=model_dir, model=model, tokenizer=tokenizer, device=dev, eos_ids=eos_ids,
                       pad_id=int(pad_id), max_context=_max_context(model, tokenizer),
                       generation_backend=generation_backend, adapter_dir=Path(adapter) if adapter else None)


def _with_adapter(model: Any, adapter: Path) -> Any:
    from peft import PeftModel

    if not (adapter / "adapter_config.json").is_file():
        raise EvalError(f"{adapter}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    except (OSError, ValueError, RuntimeError) as exc:
        raise EvalError(f"{adapter}: cannot apply the adapter to the model ({exc})") from exc
