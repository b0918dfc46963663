"""Asynchronous rollouts: the staleness bound, the queue of rollouts in flight, and decoupled
PPO's behaviour weights against numbers worked by hand."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rlx.trainer.algos import behavior_weights, masked_mean, ppo_policy_loss
from rlx.trainer.inflight import (
    RolloutQueue,
    StalenessError,
    check_staleness,
    staleness_metrics,
)
from rlx.trainer.tasks.data import PromptSampler


def test_every_sample_within_the_bound_passes():
    check_staleness(torch.tensor([3, 4, 4, 5]), policy_version=5, max_staleness=2)
    check_staleness(torch.tensor([0, 0]), policy_version=0, max_staleness=0)


@pytest.mark.parametrize(
    ("versions", "policy", "k", "text"),
    [
        (
            [4, 4, 2],
            4,
            1,
            "1 of 3 samples were made by weights version 2 but the policy is at "
            "version 4 and trainer.rollout.max_staleness 1 allows 3..4",
        ),
        ([6, 5], 5, 2, "made by weights version 6 but the policy is at version 5"),
        ([1, 2, 3], 3, 0, "2 of 3 samples were made by weights version 1..2"),
    ],
)
def test_a_sample_outside_the_bound_stops_with_one_line(versions, policy, k, text):
    with pytest.raises(StalenessError) as caught:
        check_staleness(torch.tensor(versions), policy, k)
    message = str(caught.value)
    assert text in message and "\n" not in message
    assert message.startswith(f"step {policy + 1}: ")


def test_staleness_histogram():
    metrics = staleness_metrics(torch.tensor([5, 4, 4, 3]), policy_version=5, max_staleness=2)
    assert metrics == {
        "staleness/mean": 1.0,
        "staleness/max": 2.0,
        "staleness/share_0": 0.25,
        "staleness/share_1": 0.5,
        "staleness/share_2": 0.25,
    }


@dataclass
class Done:
    step: int
    prompt_ids: list[list[int]]

    def collect(self, show_progress: bool):
        return self


def run_queue(k: int, steps: int, start: int = 1, state=None):
    """Drive a queue like the loop does; returns the rows each step took and the order in
    which steps were submitted relative to the updates (as events)."""
    sampler = PromptSampler(10, 2, seed=3)
    if state is not None:
        sampler.load_state_dict(state)
    events: list[str] = []

    def submit(rows, step):
        events.append(f"gen {step}")
        return Done(step, [[i] for i in rows])

    queue = RolloutQueue(sampler, submit, k, steps)
    trained, saved = {}, {}
    for step in range(start, steps + 1):
        queue.fill(step)
        rows, done = queue.take(step, False)
        assert done.step == step and done.prompt_ids == [[i] for i in rows]
        trained[step] = rows
        events.append(f"update {step}")
        saved[step] = queue.sampler_state_after(step)
    assert queue.in_flight() == 0  # nothing generated past the last step
    return trained, events, saved


def test_the_queue_runs_k_steps_ahead_and_every_k_trains_the_same_prompts():
    straight, events0, _ = run_queue(0, 6)
    assert events0[:4] == ["gen 1", "update 1", "gen 2", "update 2"]
    ahead, events2, saved = run_queue(2, 6)
    assert ahead == straight
    # Step t + 2's rollout starts right after update t - 1 (before update t).
    assert events2[:6] == ["gen 1", "gen 2", "gen 3", "update 1", "gen 4", "update 2"]
    # A resume from the state saved after step 3 trains steps 4..6 on the same prompts,
    # though steps 4 and 5 had already been drawn when step 3 was saved.
    resumed, _, _ = run_queue(2, 6, start=4, state=saved[3])
    assert {s: resumed[s] for s in (4, 5, 6)} == {s: straight[s] for s in (4, 5, 6)}
    every = sorted(i for rows in straight.values() for i in rows)
    assert every == sorted(list(range(10)) + [i for s in (6,) for i in straight[s]])


def test_behaviour_weights_by_hand():
    # Three tokens and a pad. proximal - behaviour = log 1.5, log 0.5, log 3 (over the cap 2).
    behaviour = torch.tensor([[-1.0, -2.0, -3.0, -9.0]])
    proximal = behaviour + torch.log(torch.tensor([[1.5, 0.5, 3.0, 7.0]]))
    mask = torch.tensor([[True, True, True, False]])
    weight, metrics = behavior_weights(proximal, behaviour, mask, cap=2.0)
    assert torch.allclose(weight, torch.tensor([[1.5, 0.5, 2.0, 0.0]]))
    assert math.isclose(
        float(metrics["offpolicy/weight_mean"]), (1.5 + 0.5 + 3.0) / 3, rel_tol=1e-6
    )
    assert math.isclose(
        float(metrics["offpolicy/weight_sq_mean"]), (2.25 + 0.25 + 9.0) / 3, rel_tol=1e-6
    )
    assert math.isclose(float(metrics["offpolicy/truncated_frac"]), 1 / 3, rel_tol=1e-6)


def test_decoupled_loss_and_gradient_by_hand():
    # ratio pi/pi_prox = 1.1, 0.7, 1.0 with eps 0.2; advantages +1, -1, +2; weights 1.5, 0.5, 2.
    proximal = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = proximal + torch.log(torch.tensor([[1.1, 0.7, 1.0]], dtype=torch.float64))
    logp.requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    weight = torch.tensor([[1.5, 0.5, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = ppo_policy_loss(
        logp, proximal, advantages, mask, clip_eps_low=0.2, behavior_weight=weight
    )
    # Token 1: min(1.1 * 1, 1.1 * 1) = 1.1 -> loss -1.5 * 1.1. Token 2: A < 0, ratio 0.7 below
    # 0.8: the pessimistic term is the clipped -0.8 * -1... max(0.7, 0.8) = 0.8 -> 0.5 * 0.8.
    # Token 3: ratio 1 -> -2 * 2.
    want = torch.tensor([[-1.5 * 1.1, 0.5 * 0.8, -2.0 * 2.0]], dtype=torch.float64)
    assert torch.allclose(loss, want)
    loss.sum().backward()
    # d/dlogp of -w * A * ratio = -w * A * ratio where unclipped, 0 where clipped.
    assert torch.allclose(logp.grad, torch.tensor([[-1.5 * 1.1, 0.0, -4.0]], dtype=torch.float64))
    assert math.isclose(float(metrics["clipfrac"]), 1 / 3, rel_tol=1e-6)
    # Without weights the same call is plain PPO.
    plain, _ = ppo_policy_loss(logp.detach(), proximal, advantages, mask, clip_eps_low=0.2)
    assert torch.allclose(plain, torch.tensor([[-1.1, 0.8, -2.0]], dtype=torch.float64))
    assert float(masked_mean(loss.detach(), mask)) == pytest.approx((-1.65 + 0.4 - 4.0) / 3)
