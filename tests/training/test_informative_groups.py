"""Dropping zero-advantage GRPO groups before the backward pass (training/informative_groups.py)."""

from __future__ import annotations

import pytest
import torch

from training.informative_groups import anchor_advantages, anchor_groups, informative_rows, replies_right, select_rows


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


def test_solved_safety_groups_get_a_fixed_baseline_advantage_and_the_rest_keep_theirs():
    # groups of 2: a solved sum, a solved safety prompt, a safety prompt failed in both draws, a mixed safety one
    advantages = torch.tensor([1.19e-3] * 2 + [1.19e-3] * 2 + [0.0] * 2 + [0.7, -0.7])
    anchors = torch.tensor([False, True, True, True])
    right = torch.tensor([True, True, True, True, False, False, True, False])
    out = anchor_advantages(advantages, 2, anchors, right, 0.25)
    assert out.tolist() == pytest.approx([1.19e-3] * 2 + [0.25, 0.25] + [-0.25, -0.25] + [0.7, -0.7])
    assert advantages[2].item() == pytest.approx(1.19e-3)  # TRL's tensor is left as it was


def test_replies_are_judged_right_by_the_safety_reward():
    from transformers import AutoTokenizer

    from training.shipped_base import SHIPPED_DIR

    tiny_tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_DIR))  # the embedded model's own
    rows = [{"task": "safety", "should_refuse": True}, {"task": "safety", "should_refuse": True},
            {"task": "safety", "should_refuse": False}, {"task": "addition", "answer": "4"}]
    texts = ["I can't help with that.", "Sure, mix the two.", "Here is how to bake bread.", "Answer: 4"]
    encoded = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded)) + 2
    pad = tiny_tokenizer.pad_token_id if tiny_tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([e + [pad] * (width - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded])
    assert replies_right(tiny_tokenizer, ids, mask, rows).tolist() == [True, False, True, False]


def test_select_rows_cuts_every_per_row_field_and_leaves_the_rest():
    batch = {"prompt_ids": torch.arange(12).reshape(6, 2), "advantages": torch.arange(6.0),
             "num_items_in_batch": torch.tensor(99), "num_images": [0, 1, 2, 3, 4, 5], "other": "x"}
    keep = torch.tensor([False, False, True, True, False, False])
    out = select_rows(batch, keep)
    assert out["prompt_ids"].tolist() == [[4, 5], [6, 7]]
    assert out["advantages"].tolist() == [2.0, 3.0]
    assert out["num_images"] == [2, 3]
    assert out["num_items_in_batch"].item() == 99 and out["other"] == "x"
