"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2; trainer.batch.filter_groups): a step
trains on prompts whose responses' scores differ, and samples more prompts until it has
prompts_per_step of them.

Under a group baseline (GRPO, RLOO, REINFORCE++-baseline) a group whose responses all scored
the same has zero advantage: it trains nothing but still counts in the loss's denominators,
so the step's signal thins as the policy gets a prompt always right or always wrong.

Prompts for the later rounds come from a sampler of their own (a second shuffled pass over
the data, seeded apart from the main one), drawn in step order when a step is trained: the
main sampler's prompts stay those of an unfiltered run at every step, whatever
rollout.max_staleness is, and a checkpoint holds both samplers, so a resume draws exactly
what the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlx.trainer.batch import RolloutBatch, join_groups

# The seed offset of the later rounds' sampler: its epochs' permutations (seed + offset +
# epoch) never meet the main sampler's (seed + epoch) in any run shorter than a million epochs.
BACKFILL_SEED_OFFSET = 1_000_003


def group_spread(
    values: torch.Tensor, group_size: int, tolerance: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Whether each group's values differ by more than `tolerance` (max - min), counting
    valid rows only (a failed episode has no score): (B,) -> (P,) bool. A group of fewer
    than two valid rows has no spread."""
    grouped = values.detach().float().reshape(-1, group_size)  # (P, G)
    ok = (
        torch.ones_like(grouped, dtype=torch.bool)
        if valid is None
        else valid.reshape(-1, group_size).bool()
    )  # (P, G)
    high = torch.where(ok, grouped, -torch.inf).max(dim=1).values  # (P,)
    low = torch.where(ok, grouped, torch.inf).min(dim=1).values  # (P,)
    return (ok.sum(dim=1) >= 2) & (high - low > tolerance)  # (P,)


@dataclass
class Round:
    """One generate call of a step: its prompt rows, samples, scores and which groups vary."""

    rows: list[int]
    rollout: RolloutBatch
    scores: torch.Tensor  # (B,) the outcome
    varied: torch.Tensor  # (P,) bool
    trained: torch.Tensor | None = None  # (B,) what the advantages read, where not the outcome


@dataclass
class Picked:
    """The groups a step trains on, by round, and what the filtering did."""

    rows: list[int]
    rollout: RolloutBatch
    scores: torch.Tensor  # (B,) the picked groups' outcomes, as scored
    kept: int  # picked groups that vary
    dropped: int  # groups generated and not trained
    rounds: int
    short: bool = field(default=False)  # fewer varied groups than the step needs
    trained: torch.Tensor | None = None  # (B,) the picked groups' Round.trained


def pick_groups(rounds: Sequence[Round], groups: int) -> Picked:
    """The first `groups` varied groups of the rounds, in the order they were generated;
    with fewer, the first unvaried ones fill the step (they train nothing under a group
    baseline, and keep the step's shape)."""
    varied: list[tuple[int, int]] = []
    unvaried: list[tuple[int, int]] = []
    for index, one in enumerate(rounds):
        for group, ok in enumerate(one.varied.tolist()):
            (varied if ok else unvaried).append((index, group))
    chosen = varied[:groups]
    short = len(chosen) < groups
    chosen += unvaried[: groups - len(chosen)]
    n = rounds[0].rollout.n
    rows = [rounds[i].rows[g] for i, g in chosen]
    scores = torch.cat([rounds[i].scores[g * n : (g + 1) * n] for i, g in chosen])
    trained = None
    if rounds[0].trained is not None:
        trained = torch.cat([rounds[i].trained[g * n : (g + 1) * n] for i, g in chosen])  # type: ignore[index]
    total = sum(len(one.rows) for one in rounds)
    return Picked(
        rows=rows,
        rollout=join_groups([(rounds[i].rollout, g) for i, g in chosen]),
        scores=scores,
        kept=min(len(varied), groups),
        dropped=total - groups,
        rounds=len(rounds),
        short=short,
        trained=trained,
    )
