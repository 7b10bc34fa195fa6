"""One entry of a step's plan: a sequence and how many of its tokens the step computes.

It lives apart from the scheduler because everything downstream of a plan reads it (the runner, the decode
graphs, the step-input builders, the speculation commit, the memory profile) while the scheduler is only the
one that writes it; with the record here, none of them has to import the scheduler to name what it receives.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.sequence import Sequence

__all__ = ["ScheduledSeq"]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step, from seq.num_computed_tokens
