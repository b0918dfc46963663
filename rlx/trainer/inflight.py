"""Batches in flight: with trainer.rollout.max_staleness = k the controller keeps the
rollouts of up to k steps ahead of the one it trains under way on the engines.

Step t trains the policy of version t - 1 (t - 1 updates done) on a batch whose samples were
made by some version v. The bound every batch is checked against is

    (t - 1) - k <= v <= t - 1

At k = 0 every batch is generated after the previous update was pushed (the synchronous
loop). At k > 0 the batch of step t + k is started right after version t - 1 was pushed, so
its samples are exactly k versions old when step t + k trains on them; the engines make it
while the learners train on steps t .. t + k - 1.

Prompts are drawn for each step in step order whatever k is, so every k trains the same
prompts at the same step. A checkpoint after step t stores the sampler as it was before the
prompts of step t + 1 were drawn: a resume draws them again and generates them with the
resumed weights (staleness 0 for those), so no prompt is trained twice or skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlx.errors import RlxError
from rlx.runs import STALENESS
from rlx.trainer.batch import RolloutBatch
from rlx.trainer.tasks.data import PromptSampler


class StalenessError(RlxError):
    """A batch holds samples outside the staleness bound."""


def check_staleness(versions: torch.Tensor, policy_version: int, max_staleness: int) -> None:
    """Every sample's weights version within [policy_version - k, policy_version], or one
    line naming how many samples are out and what the bound allows."""
    low = policy_version - max_staleness
    outside = (versions < low) | (versions > policy_version)  # (B,)
    if bool(outside.any()):
        bad = versions[outside]
        raise StalenessError(
            f"step {policy_version + 1}: {int(outside.sum())} of {len(versions)} samples were "
            f"made by weights version {int(bad.min())}"
            + (f"..{int(bad.max())}" if int(bad.max()) != int(bad.min()) else "")
            + f" but the policy is at version {policy_version} and "
            f"trainer.rollout.max_staleness {max_staleness} allows {max(low, 0)}.."
            f"{policy_version}; the run stops (a weight push or the rollout queue is wrong)"
        )


def staleness_metrics(
    versions: torch.Tensor, policy_version: int, max_staleness: int
) -> dict[str, float]:
    """How old the trained samples are: mean and max lag in versions, and the share of
    samples at each lag 0..k (the histogram, one metric per bucket)."""
    lag = (policy_version - versions).float()  # (B,)
    metrics = {STALENESS: float(lag.mean()), "staleness/max": float(lag.max())}
    for value in range(max_staleness + 1):
        metrics[f"staleness/share_{value}"] = float((lag == value).float().mean())
    return metrics


@dataclass
class Submitted:
    """One step's rollout as submitted: its prompt rows and the call under way."""

    rows: list[int]
    pending: Any  # PendingRollout (or anything with collect(show_progress))


class RolloutQueue:
    """The rollouts of the steps ahead, started in step order.

    submit(rows, step) starts one step's rollout of those prompt rows and returns a handle
    with collect(show_progress) -> RolloutBatch (Trainer.submit_rollout)."""

    def __init__(
        self,
        sampler: PromptSampler,
        submit: Callable[[list[int], int], Any],
        max_staleness: int,
        last_step: int,
    ):
        self.sampler = sampler
        self.submit = submit
        self.max_staleness = max_staleness
        self.last_step = last_step
        self.steps: dict[int, Submitted] = {}
        self.sampler_before: dict[int, dict[str, Any]] = {}  # step -> sampler state before it
        self.next_step: int | None = None

    def fill(self, step: int) -> None:
        """Have steps step .. step + k (none past the last) started, in step order."""
        if self.next_step is None:
            self.next_step = step
        while self.next_step <= min(step + self.max_staleness, self.last_step):
            at = self.next_step
            self.sampler_before[at] = self.sampler.state_dict()
            rows = next(self.sampler)
            self.steps[at] = Submitted(rows, self.submit(rows, at))
            self.next_step += 1

    def take(self, step: int, show_progress: bool) -> tuple[list[int], RolloutBatch]:
        """Step `step`'s prompt rows and its samples (waiting for them)."""
        submitted = self.steps.pop(step)
        self.sampler_before.pop(step - 1, None)
        return submitted.rows, submitted.pending.collect(show_progress)

    def sampler_state_after(self, step: int) -> dict[str, Any]:
        """The sampler as it was once exactly the prompts of steps .. `step` were drawn: what a
        checkpoint after `step` stores, so a resume draws the prompts in flight again."""
        if step + 1 in self.sampler_before:
            return self.sampler_before[step + 1]
        return self.sampler.state_dict()

    def in_flight(self) -> int:
        return len(self.steps)
