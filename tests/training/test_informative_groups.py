"""Dropping zero-advantage GRPO groups before the backward pass (training/informative_groups.py)."""

from __future__ import annotations

import torch

from training.informative_groups import anchor_groups, informative_rows, select_rows


def test_only_groups_whose_replies_scored_differently_are_kept():
    # three groups of 4 replies: all right, mixed, all wrong. Equal rewards give equal advantages, but not 0:
    # TRL's float32 group mean is off by ~1e-7 and its 1e-4 std floor turns that into +1.19e-3 for each reply.
    advantages = torch.tensor([1.19e-3] * 4 + [1.2, -0.4, -0.4, -0.4] + [0.0] * 4)
    keep = informative_rows(advantages, group_size=4)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_an_all_solved_batch_keeps_its_first_group():
    advantages = torch.tensor([1.19e-3] * 3 + [0.0] * 3)
    assert informative_rows(advantages, group_size=3).tolist() == [True] * 3 + [False] * 3


def test_safety_groups_stay_as_anchors_even_when_every_reply_was_right():
    # a solved sum, a solved safety prompt, a mixed sum: the safety group stays for its KL term
    rows = [{"task": "addition"}] * 2 + [{"task": "safety"}] * 2 + [{"task": "addition"}] * 2
    advantages = torch.tensor([1.19e-3] * 2 + [1.19e-3] * 2 + [0.7, -0.7])
    anchors = anchor_groups(rows, group_size=2)
    assert anchors.tolist() == [False, True, False]
    assert informative_rows(advantages, 2, anchors).tolist() == [False, False, True, True, True, True]
    assert informative_rows(advantages, 2).tolist() == [False, False, False, False, True, True]


def test_select_rows_cuts_every_per_row_field_and_leaves_the_rest():
    batch = {"prompt_ids": torch.arange(12).reshape(6, 2), "advantages": torch.arange(6.0),
             "num_items_in_batch": torch.tensor(99), "num_images": [0, 1, 2, 3, 4, 5], "other": "x"}
    keep = torch.tensor([False, False, True, True, False, False])
    out = select_rows(batch, keep)
    assert out["prompt_ids"].tolist() == [[4, 5], [6, 7]]
    assert out["advantages"].tolist() == [2.0, 3.0]
    assert out["num_images"] == [2, 3]
    assert out["num_items_in_batch"].item() == 99 and out["other"] == "x"
