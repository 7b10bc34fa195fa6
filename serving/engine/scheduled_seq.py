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
    # set when the step is launched (``Scheduler.launched``): the first position it computes, and where in
    # ``seq.token_ids`` its sampled token goes (-1: it samples none); the step's result is applied by these, since
    # with async scheduling the next step has moved the sequence on by then
    start: int = -1
    sample_index: int = -1
