"""Train GRPO only on the groups that carry a learning signal (DAPO's dynamic sampling, without the refill).

A group whose replies all earned the same reward (all right, or all wrong) has zero advantage for every
reply: with no KL term it adds nothing to the policy gradient, yet TRL still runs the policy's forward and
backward pass over it, the most expensive part of a GRPO step on a small model. Once the policy solves most
training prompts, most groups are like that. Dropping them before the backward pass spends the stage's time
on the prompts it can still learn from, and the DAPO token-mean loss is then a mean over the tokens that
carry signal (DAPO's own normalisation).

With `beta > 0` a dropped group also loses its KL term; the reference still anchors every group that is
trained on, and the KL is still measured on those. That is what the safety prompts need kept
(`GRPOStageConfig.anchor_safety_groups`): a policy that refuses a harmful prompt in every draw has nothing to
learn from it, but the task updates still move it, and with no term looking at those prompts the refusals
drifted (held-out 0.953 after DPO, 0.884 after GRPO on one chain, every draw of its safety training prompts
still right). Kept in the loss, those groups add no advantage, only the KL pull towards the reference.
"""

from __future__ import annotations

from typing import Any

# Advantages are (reward - group mean) / (group std + 1e-4). Equal rewards do not give 0: the float32 mean of
# eight rewards of 1.2 differs from 1.2 by ~1e-7, which the 1e-4 floor turns into the same +1.2e-3 for every
# reply (TRL's own `frac_reward_zero_std` then counts no such group). What equal rewards do give is equal
# advantages, so a group carries signal only when its advantages differ.
NO_SPREAD = 1e-6


def informative_groups(advantages: Any, group_size: int) -> Any:
    """One boolean per group: whether its replies' advantages differ (TRL lays out each prompt's `group_size`
    replies as consecutive rows)."""
    grouped = advantages.detach().reshape(-1, group_size)
    return (grouped.amax(dim=1) - grouped.amin(dim=1)) > NO_SPREAD


def informative_rows(advantages: Any, group_size: int, anchors: Any = None) -> Any:
    """A boolean mask over the batch's rows: True for every reply of an informative group, and of every group
    ``anchors`` (one boolean per group) marks. When no group is kept the first one is, so the step still has a
    batch to run and the trainer's bookkeeping holds; its equal, near-zero advantages make that step negligible."""
    groups = informative_groups(advantages, group_size).clone()
    if anchors is not None:
        groups |= anchors.to(groups.device)
    if not bool(groups.any()):
        groups[0] = True
    return groups.repeat_interleave(group_size)


def anchor_groups(rows: list[dict[str, Any]], group_size: int) -> Any:
    """One boolean per group: whether its prompt is a safety prompt (TRL's inputs, one row per reply)."""
    import torch

    from training.tasks import SAFETY_TASK

    return torch.tensor([rows[i].get("task") == SAFETY_TASK for i in range(0, len(rows), group_size)])


def select_rows(batch: dict[str, Any], keep: Any) -> dict[str, Any]:
    """The rows of a TRL generation batch that `keep` marks; per-row tensors and lists are cut, and the token
    count the DAPO loss divides by (`num_items_in_batch`) is left for the caller to recount."""
    rows = int(keep.numel())
    index = keep.nonzero(as_tuple=True)[0]
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if hasattr(value, "shape") and value.dim() >= 1 and value.shape[0] == rows:
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and len(value) == rows:
            out[key] = [item for item, kept in zip(value, keep.tolist()) if kept]
        else:
            out[key] = value
    return out


def informative_groups_trainer(base: type, anchor_safety: bool = False) -> type:
    """A subclass of TRL's `GRPOTrainer` (passed in, so TRL is imported only when a stage runs) that trains
    on informative groups only and logs the share it kept as `informative_group_fraction`. With
    ``anchor_safety`` (``GRPOStageConfig.keeps_safety_anchors``) the safety prompts' groups stay too,
    informative or not: see the module docstring."""

    class InformativeGroupsGRPOTrainer(base):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            batch = super()._generate_and_score_completions(inputs)
            if not self.model.training:
                return batch
            groups = informative_groups(batch["advantages"], self.num_generations)
            self._metrics["train"]["informative_group_fraction"].append(groups.float().mean().item())
            anchors = anchor_groups(inputs, self.num_generations) if anchor_safety else None
            kept = select_rows(batch, informative_rows(batch["advantages"], self.num_generations, anchors))
            mask = kept["completion_mask"] if "tool_mask" not in kept else kept["completion_mask"] * kept["tool_mask"]
            kept["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
            return kept

    return InformativeGroupsGRPOTrainer
