"""What a suite gets to work with: the loaded model, the data dir and the run's limits.

Why a shared context: several suites read the same file or need the same greedy replies
(task accuracy and format adherence score one set of generations), and the evals run several times
per pipeline run on a small CPU, so files are read once and every prompt is generated at most once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.config import EvalConfig
from evals.data import Record, read_jsonl, take_stratified
from evals.generation import Generation, generate_replies
from evals.model import LoadedModel


@dataclass
class EvalContext:
    lm: LoadedModel
    data_dir: Path
    config: EvalConfig = field(default_factory=EvalConfig)  # the limits: max_examples, max_new_tokens, ...
    _files: dict[str, list[Record]] = field(default_factory=dict, repr=False)
    _replies: dict[str, Generation] = field(default_factory=dict, repr=False)
    _samples: dict[str, list[Generation]] = field(default_factory=dict, repr=False)
    _constrained: dict[tuple[str, str], Generation] = field(default_factory=dict, repr=False)

    def records(self, filename: str, required: dict[str, type | tuple[type, ...]],
                stratify: Callable[[Record], str] = lambda r: "",
                check: Callable[[Record], str | None] | None = None) -> list[Record]:
        """The records of ``data_dir/filename`` (validated), limited to ``max_examples`` per file,
        drawn across the strata named by ``stratify`` so every slice keeps examples."""
        if filename not in self._files:
            self._files[filename] = read_jsonl(self.data_dir / filename, required, check)
        return take_stratified(self._files[filename], self.config.max_examples, stratify)

    def generate(self, prompts: list[str], desc: str, min_new_tokens: int = 0) -> list[Generation]:
        """Greedy replies to templated prompts, each up to ``max_new_tokens`` (or ``min_new_tokens``, where a suite's
        replies are longer than a plain task's); prompts seen before in this run are not generated again."""
        todo = list(dict.fromkeys(p for p in prompts if p not in self._replies))
        if todo:
            c = self.config
            fresh = generate_replies(self.lm, todo, max(c.max_new_tokens, min_new_tokens), c.batch_size, desc=desc)
            self._replies.update(zip(todo, fresh, strict=True))
        return [self._replies[p] for p in prompts]

    def sample(self, prompts: list[str], desc: str) -> list[list[Generation]]:
        """``samples_per_prompt`` replies per templated prompt at ``sample_temperature``, seeded, cached
        like :meth:`generate`; all prompts' samples go through one packed, sorted pass."""
        todo = list(dict.fromkeys(p for p in prompts if p not in self._samples))
        if todo:
            c, k = self.config, self.config.samples_per_prompt
            flat = generate_replies(self.lm, [p for p in todo for _ in range(k)], c.max_new_tokens, c.batch_size,
                                    desc=desc, temperature=c.sample_temperature, seed=c.sample_seed)
            self._samples.update((p, flat[i * k:(i + 1) * k]) for i, p in enumerate(todo))
        return [self._samples[p] for p in prompts]

    def generate_constrained(self, prompts: list[str], schemas: list[dict[str, Any]], desc: str,
                             min_new_tokens: int = 0) -> list[Generation]:
        """Greedy replies to templated prompts, each constrained to its JSON schema (its room as in
        :meth:`generate`); cached by (prompt, schema)."""
        keys = [(p, json.dumps(s)) for p, s in zip(prompts, schemas, strict=True)]  # key order kept: it orders replies
        todo = list(dict.fromkeys(k for k in keys if k not in self._constrained))
        if todo:
            c = self.config
            fresh = generate_replies(self.lm, [p for p, _ in todo], max(c.max_new_tokens, min_new_tokens),
                                     c.batch_size, desc=desc,
                                     schemas=[json.loads(s) for _, s in todo])
            self._constrained.update(zip(todo, fresh, strict=True))
        return [self._constrained[k] for k in keys]

    def user_prompt(self, content: str) -> str:
        return self.lm.chat_prompt([{"role": "user", "content": content}])
