"""The eval run's configuration (maps 1:1 to the ``evals:`` block of a pipeline recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field

from evals.suite_names import suite_names

GENERATION_BACKENDS = ("auto", "engine", "transformers")  # EvalConfig.generation_backend


@dataclass
class EvalConfig:
    """Which suites to run and how much work to do.

    ``max_examples`` caps the records read from each data file (drawn across tasks/categories so every
    slice survives); ``max_new_tokens`` caps each reply; ``batch_size`` is prompts (or scored
    sequences) per forward pass. ``sampled_task_accuracy`` draws ``samples_per_prompt`` replies per
    held-out task at ``sample_temperature`` (1.0: what our server gives a request that names none when
    the model's generation_config.json sets no temperature either),
    seeded by ``sample_seed`` so two models are scored on the same draws. The ``structured`` suite asks
    ``structured_examples`` of the held-out tasks for JSON (null: all of them).
    """

    suites: list[str] = field(default_factory=suite_names)
    max_examples: int | None = None
    max_new_tokens: int = 16
    batch_size: int = 32
    samples_per_prompt: int = 4
    sample_temperature: float = 1.0
    sample_seed: int = 0
    # the structured suite asks this many of the held-out tasks (drawn across tasks) twice more, once under the
    # grammar: enough to see a broken promise, and two generation passes over every held-out task would cost
    # each of a pipeline's evals more than the suites it has
    structured_examples: int | None = 64
    # who writes the generation suites' replies (evals.engine_generation): "auto", our serving engine wherever it
    # loads the model (what is evaluated is what `lifecycle serve` serves), else transformers; "engine";
    # "transformers"
    generation_backend: str = "auto"

    def __post_init__(self) -> None:
        known = suite_names()
        if isinstance(self.suites, str) or not isinstance(self.suites, list):
            message = f"suites: must be a list of suite names (known: {', '.join(known)})"
            raise ValueError(message)  # noqa: TRY004 (the recipe loader expects ValueError)
        if not self.suites:
            raise ValueError(f"suites: empty; pick from {', '.join(known)}")
        for name in self.suites:
            if name not in known:
                raise ValueError(f"suites: unknown suite {name!r} (known: {', '.join(known)})")
        if len(set(self.suites)) != len(self.suites):
            raise ValueError("suites: a suite is listed twice")
        if self.max_examples is not None and (isinstance(self.max_examples, bool) or self.max_examples < 1):
            raise ValueError(f"max_examples: must be a positive integer or null, got {self.max_examples!r}")
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size!r}")
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(f"generation_backend: must be one of {', '.join(GENERATION_BACKENDS)}, got "
                             f"{self.generation_backend!r}")
        structured = self.structured_examples
        if structured is not None and (isinstance(structured, bool) or structured < 1):
            raise ValueError(f"structured_examples: must be a positive integer or null, got {structured!r}")
        if isinstance(self.samples_per_prompt, bool) or self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt: must be >= 1, got {self.samples_per_prompt!r}")
        if isinstance(self.sample_temperature, bool) or not self.sample_temperature > 0:
            raise ValueError(f"sample_temperature: must be > 0 (0 is the greedy task_accuracy), "
                             f"got {self.sample_temperature!r}")
