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
import torch.nn.functional as F

from rlx.trainer.batch import RolloutBatch

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


def _padded(tensor: torch.Tensor, width: int, value: float | bool) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]), value=value)


def join_groups(picks: Sequence[tuple[RolloutBatch, int]]) -> RolloutBatch:
    """One rollout of the groups picked, in the order given: (batch, group index) each, the
    batches alike in n and pad token. Every per-row field travels, episodes' included;
    responses are right-padded to the longest."""
    if not picks:
        raise ValueError("join_groups needs at least one group")
    first = picks[0][0]
    n, pad = first.n, first.pad_token_id
    width = max(batch.response_ids.shape[1] for batch, _ in picks)
    with_loss_mask = any(batch.loss_mask is not None for batch, _ in picks)
    with_token_rewards = any(batch.token_rewards is not None for batch, _ in picks)
    with_episodes = any(batch.episodes is not None for batch, _ in picks)
    parts: dict[str, list] = {k: [] for k in ("ids", "mask", "logp", "done", "ver", "lm", "tr")}
    prompts: list[list[int]] = []
    episodes: list = []
    for batch, group in picks:
        if batch.n != n or batch.pad_token_id != pad:
            raise ValueError("rollout batches disagree on n or on the pad token")
        rows = slice(group * n, (group + 1) * n)
        parts["ids"].append(_padded(batch.response_ids[rows], width, pad))
        parts["mask"].append(_padded(batch.response_mask[rows], width, False))
        parts["logp"].append(_padded(batch.logprobs[rows], width, 0.0))
        parts["done"].append(batch.finished[rows])
        parts["ver"].append(batch.row_versions[rows])
        if with_loss_mask:
            loss_mask = batch.response_mask if batch.loss_mask is None else batch.loss_mask
            parts["lm"].append(_padded(loss_mask[rows], width, False))
        if with_token_rewards:
            assert batch.token_rewards is not None, "a round without its episodes' rewards"
            parts["tr"].append(_padded(batch.token_rewards[rows], width, 0.0))
        if with_episodes:
            assert batch.episodes is not None, "a round without its episodes"
            episodes.extend(batch.episodes[rows])
        prompts.extend(batch.prompt_ids[rows])
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=torch.cat(parts["ids"]),
        response_mask=torch.cat(parts["mask"]),
        logprobs=torch.cat(parts["logp"]),
        finished=torch.cat(parts["done"]),
        n=n,
        pad_token_id=pad,
        weight_version=min(batch.weight_version for batch, _ in picks),
        versions=torch.cat(parts["ver"]),
        loss_mask=torch.cat(parts["lm"]) if with_loss_mask else None,
        token_rewards=torch.cat(parts["tr"]) if with_token_rewards else None,
        episodes=episodes if with_episodes else None,
    )


@dataclass
class Round:
    """One generate call of a step: its prompt rows, samples, scores and which groups vary."""

    rows: list[int]
    rollout: RolloutBatch
    scores: torch.Tensor  # (B,) the outcome
    varied: torch.Tensor  # (P,) bool


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
    total = sum(len(one.rows) for one in rounds)
    return Picked(
        rows=rows,
        rollout=join_groups([(rounds[i].rollout, g) for i, g in chosen]),
        scores=scores,
        kept=min(len(varied), groups),
        dropped=total - groups,
        rounds=len(rounds),
        short=short,
    )
