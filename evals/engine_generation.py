"""The generation suites' replies from our serving engine: what is evaluated is what ``lifecycle serve`` serves.

Why: every pipeline run evaluates seven models (base, each stage, each bundle) and mines DPO pairs, and with
plain ``transformers`` generation that was ~250 s of a ~30-minute ``make run``: a 4-bit bundle decoded through
its quantization library's kernels took 71 s. The engine decodes the same batches with paged KV and its own
kernels, and serves a GPTQ/AWQ bundle from its 4-bit codes, exactly as the server will. Greedy replies are
the engine's greedy tokens (equal to ``transformers``' on the models the engine's tests pin); sampled replies
draw from the same distribution, each from its own seeded generator, so draw ``i`` of a prompt list is the same
whatever the batch layout (``request_seed``).

``EvalConfig.generation_backend`` (a recipe's ``evals.generation_backend``) chooses: ``auto`` runs the engine
where it loads the model and falls back to ``transformers`` with the reason logged; ``engine`` insists;
``transformers`` never starts it. Constrained (JSON schema) replies stay with ``transformers`` and the suite's
own logits masks (evals.constrained), which the structured suite's figures were measured with.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.errors import EvalError

log = logging.getLogger(__name__)

ADAPTER_NAME = "evaluated"
BLOCK_SIZE = 16


def request_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th reply of a pass seeded with ``seed``: distinct for every (seed, index), and
    the same for the same reply of every model, so two models' sampled scores compare draw by draw."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # the engine takes seeds below 2**63


@dataclass(frozen=True)
class EngineReply:
    token_ids: list[int]  # without the stop token
    stopped_on_eos: bool


class EngineGenerator:
    """An engine over the evaluated model's directory (and its adapter, in a LoRA slot, when it has one)."""

    def __init__(self, engine: Any, eos_ids: list[int], adapter: str | None) -> None:
        self.engine, self.eos_ids, self.adapter = engine, list(eos_ids), adapter

    @classmethod
    def start(cls, model_dir: Path, *, device: str, eos_ids: list[int], batch_size: int, max_context: int,
              adapter_dir: Path | None = None) -> EngineGenerator:
        """Raises EvalError naming why when the engine cannot serve this model."""
        from serving.engine.config import EngineConfig
        from serving.engine.engine import LLMEngine
        from serving.engine.errors import EngineError

        per_seq = math.ceil(min(max_context, 4096) / BLOCK_SIZE) + 1
        config = EngineConfig(device=device, dtype="float32" if device == "cpu" else "auto", block_size=BLOCK_SIZE,
                              num_blocks=batch_size * per_seq, max_num_seqs=batch_size,
                              max_queue=max(256, batch_size), max_num_batched_tokens=max(2048, 16 * batch_size),
                              max_loras=1 if adapter_dir is not None else 0, max_lora_rank=64, threads=None)
        try:
            engine = LLMEngine.from_pretrained(model_dir, config)
            if adapter_dir is not None:
                engine.load_lora(ADAPTER_NAME, adapter_dir)
        except (EngineError, ValueError, OSError, RuntimeError) as exc:
            raise EvalError(f"{model_dir}: the serving engine cannot generate for this model ({exc})") from None
        return cls(engine, eos_ids, ADAPTER_NAME if adapter_dir is not None else None)

    def replies(self, encoded: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                on_finished: Callable[[Any], None] | None = None) -> list[EngineReply]:
        """One reply per prompt, in order: greedy at ``temperature`` 0, else sampled (the whole distribution, no
        top-p or top-k), reply ``i`` from the generator ``request_seed(seed, i)``."""
        from serving.engine.sampling_params import SamplingParams

        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 stop_token_ids=self.eos_ids, ignore_eos=True, skip_special_tokens=False,
                                 seed=request_seed(seed, i) if temperature > 0 else None)
                  for i in range(len(encoded))]
        outputs = self.engine.generate(encoded, params, loras=[self.adapter] * len(encoded), on_finished=on_finished)
        replies = []
        for out in outputs:
            if out.error is not None:
                raise EvalError(f"the serving engine failed a reply ({out.error})")
            ids, stopped = list(out.token_ids), out.finish_reason == "stop"
            if stopped and ids and ids[-1] in self.eos_ids:  # the engine keeps the stop token; a reply does not
                ids.pop()
            replies.append(EngineReply(ids, stopped))
        return replies


def engine_generator(lm: Any, batch_size: int) -> EngineGenerator | None:
    """The loaded model's engine, started on first use and kept; None where ``lm.generation_backend`` says
    transformers, or (``auto``) where the engine cannot load the model, which is logged once."""
    if lm.generation_backend == "transformers" or lm.model_dir is None:
        return None
    if lm.engine is not None:
        return lm.engine
    if lm.engine_refusal is not None:
        return None
    try:
        lm.engine = EngineGenerator.start(lm.model_dir, device=str(lm.device), eos_ids=lm.eos_ids,
                                          batch_size=batch_size, max_context=lm.max_context,
                                          adapter_dir=lm.adapter_dir)
    except EvalError as exc:
        if lm.generation_backend == "engine":
            raise
        lm.engine_refusal = str(exc)
        log.info("evals: replies generated by transformers: %s", exc)
        return None
    return lm.engine
