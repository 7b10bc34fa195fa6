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

That pull alone was not always enough (one held-out harmful prompt of 43 still went on two chains of three, at
β 0.04, 0.06 and 0.08 alike): the KL term only slows the drift, while nothing pushes back. The group-relative
baseline is why: a prompt the policy refuses in every draw has its mean subtracted away. `anchor_advantages`
gives those groups a fixed baseline instead (``GRPOStageConfig.safety_anchor_advantage``): each right reply
of a solved safety prompt gets +a, a wrong one -a, which is on-policy fine-tuning on the policy's own right
answers (the RAFT / ReST recipe) for the prompts the task updates would otherwise move unopposed.
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


def anchor_advantages(advantages: Any, group_size: int, anchors: Any, right: Any, size: float) -> Any:
    """``advantages`` with every anchor group whose replies carry no spread set to ``+size`` for a right reply
    and ``-size`` for a wrong one (``right``: one boolean per row); informative groups keep TRL's values."""
    grouped = advantages.detach().reshape(-1, group_size).clone()
    flat = anchors.to(grouped.device) & ~informative_groups(advantages, group_size)
    signs = right.to(grouped.device).reshape(-1, group_size).to(grouped.dtype) * 2 - 1
    grouped[flat] = size * signs[flat]
    return grouped.reshape(advantages.shape)


def replies_right(tokenizer: Any, completion_ids: Any, completion_mask: Any, rows: list[dict[str, Any]]) -> Any:
    """One boolean per reply: whether the safety reward (training.rewards.refusal_reward) scores it right;
    False for a task prompt's reply, which this is never asked about."""
    import torch

    from training.rewards import refusal_reward

    texts = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
             for ids, mask in zip(completion_ids, completion_mask)]
    scores = refusal_reward(texts, should_refuse=[bool(r.get("should_refuse", False)) for r in rows],
                            task=[r.get("task") for r in rows])
    return torch.tensor([score == 1.0 for score in scores])


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


def informative_groups_trainer(base: type, anchor_safety: bool = False, anchor_advantage: float = 0.0) -> type:
    """A subclass of TRL's `GRPOTrainer` (passed in, so TRL is imported only when a stage runs) that trains
    on informative groups only and logs the share it kept as `informative_group_fraction`. With
    ``anchor_safety`` the safety prompts' groups stay too, informative or not, held by the KL term (β > 0)
    and, with ``anchor_advantage > 0``, by a fixed-baseline advantage: see the module docstring."""

    class InformativeGroupsGRPOTrainer(base):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            batch = super()._generate_and_score_completions(inputs)
            if not self.model.training:
                return batch
            groups = informative_groups(batch["advantages"], self.num_generations)
            self._metrics["train"]["informative_group_fraction"].append(groups.float().mean().item())
            anchored = anchor_safety and (self.beta or anchor_advantage > 0)
            anchors = anchor_groups(inputs, self.num_generations) if anchored else None
            if anchors is not None and anchor_advantage > 0:
                right = replies_right(self.processing_class, batch["completion_ids"], batch["completion_mask"],
                                      inputs)
                batch["advantages"] = anchor_advantages(batch["advantages"], self.num_generations, anchors,
                                                        right, anchor_advantage)
                held = (anchors.to(groups.device) & ~groups).float().mean().item()
                self._metrics["train"]["fixed_baseline_group_fraction"].append(held)
            kept = select_rows(batch, informative_rows(batch["advantages"], self.num_generations, anchors))
            mask = kept["completion_mask"] if "tool_mask" not in kept else kept["completion_mask"] * kept["tool_mask"]
            kept["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
            return kept

    return InformativeGroupsGRPOTrainer
