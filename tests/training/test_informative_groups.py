"""Dropping zero-advantage GRPO groups before the backward pass (training/informative_groups.py)."""

from __future__ import annotations

import torch

from training.informative_groups import informative_rows, select_rows


def test_only_groups_with_a_nonzero_advantage_are_kept():
    # three groups of 4 replies: all right (0 advantage), mixed, all wrong (0 advantage)
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.2, -0.4, -0.4, -0.4, 0.0, 0.0, 0.0, 0.0])
    keep = informative_rows(advantages, group_size=4)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_rounding_noise_is_not_a_signal_and_an_all_solved_batch_keeps_one_group():
    advantages = torch.tensor([2e-12, -2e-12, 0.0, 0.0, 0.0, 0.0])
    assert informative_rows(advantages, group_size=3).tolist() == [True] * 3 + [False] * 3


def test_select_rows_cuts_every_per_row_field_and_leaves_the_rest():
    batch = {"prompt_ids": torch.arange(12).reshape(6, 2), "advantages": torch.arange(6.0),
             "num_items_in_batch": torch.tensor(99), "num_images": [0, 1, 2, 3, 4, 5], "other": "x"}
    keep = torch.tensor([False, False, True, True, False, False])
    out = select_rows(batch, keep)
    assert out["prompt_ids"].tolist() == [[4, 5], [6, 7]]
    assert out["advantages"].tolist() == [2.0, 3.0]
    assert out["num_images"] == [2, 3]
    assert out["num_items_in_batch"].item() == 99 and out["other"] == "x"
