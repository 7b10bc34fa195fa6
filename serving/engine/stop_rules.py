"""When a request is done: the stop rules checked after every token a step appends.

One function for every path that appends tokens (a sampled token, or a run of accepted guesses), so a
rule lands on the same token whichever path produced it.
"""

from __future__ import annotations

from serving.engine.sequence import Sequence
from serving.engine.structured_output import advance


def stopped_after(seq: Sequence, token: int, max_model_len: int) -> bool:
    """Whether ``token``, just appended to ``seq``, ends it; sets ``finish_reason`` (and ``stop_reason``).

    In order: a constrained reply's grammar seeing a complete reply, a stop id or eos (only past
    ``min_tokens``), a stop string (the detokenizer finds it in the text, so it also cuts the text there), then
    the length limits (``max_tokens``, the context).
    """
    p = seq.params
    if seq.grammar is not None and advance(seq.grammar, token):  # the constrained reply is complete
        seq.finish_reason = "stop"
        ends = token in seq.eos_token_ids or token in p.stop_token_ids  # an end token is not text
        if seq.detokenizer is not None and not ends:
            seq.detokenizer.add_token(token)
        return True
    if seq.num_output_tokens >= p.min_tokens:
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if not p.ignore_eos and token in seq.eos_token_ids:
            seq.finish_reason = "stop"
            return True
    detok = seq.detokenizer
    if detok is not None:
        hit = detok.add_token(token)
        if hit is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
            return True
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        return True
    return False
