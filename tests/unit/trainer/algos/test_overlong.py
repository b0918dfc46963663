"""DAPO's overlong handling: the soft penalty against hand-computed values, and what a step
trains on with responses cut at the limit (masked from the loss and from their group's
baseline), while the outcome the metrics report stays the reward function's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlx.errors import RlxError
from rlx.recipe.model import AlgorithmSettings
from rlx.trainer.algos import get_advantage_estimator, overlong_penalty
from rlx.trainer.batch import SequenceBatch, outcome_token_rewards
from rlx.trainer.loop import StepRewards, Trainer


def test_the_penalty_is_zero_before_the_buffer_and_falls_linearly_to_the_limit() -> None:
    lengths = torch.tensor([1, 12, 13, 14, 15, 16, 17])
    got = overlong_penalty(lengths, max_length=16, buffer=4, factor=0.5)
    # L - b = 12: 0 up to 12 tokens, then (12 - length) / 4 x 0.5, -0.5 at 16 and beyond.
    want = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_no_buffer_punishes_nothing_up_to_the_limit() -> None:
    got = overlong_penalty(torch.tensor([0, 8, 16, 17]), max_length=16, buffer=0)
    assert got.tolist() == [0.0, 0.0, 0.0, -1.0]


def _step(lengths: list[int], finished: list[bool], scores: list[float]):
    width = max(lengths)
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])  # (B, R)
    batch = SequenceBatch(
        input_ids=torch.zeros((len(lengths), 2 + width), dtype=torch.long),
        attention_mask=torch.ones((len(lengths), 2 + width), dtype=torch.long),
        response_mask=mask,
        prompt_width=2,
    )
    score = torch.tensor(scores)
    rewards = StepRewards(outcome_token_rewards(score, mask), score)
    rollout = SimpleNamespace(episodes=None, finished=torch.tensor(finished))
    return batch, rollout, rewards


def _trainer(max_new_tokens: int, **overlong: object) -> SimpleNamespace:
    algo = AlgorithmSettings(overlong=overlong)
    settings = SimpleNamespace(algo=algo, rollout=SimpleNamespace(max_new_tokens=max_new_tokens))
    return SimpleNamespace(settings=settings)


def test_cut_responses_leave_the_loss_and_their_groups_baseline() -> None:
    # One group of 4: the third response was cut at the limit (no EOS), scored 1.
    batch, rollout, rewards = _step([3, 2, 4, 1], [True, True, False, True], [1.0, 0.0, 1.0, 0.0])
    trainer = _trainer(4, mask_truncated=True)
    shaped_batch, shaped, metrics = Trainer.overlong(trainer, batch, rollout, rewards)
    assert shaped_batch.response_mask[2].sum() == 0  # nothing of it trains
    assert shaped_batch.response_mask[[0, 1, 3]].equal(batch.response_mask[[0, 1, 3]])
    assert metrics == {"overlong/truncated_fraction": 0.25}
    assert shaped.scores.equal(rewards.scores)  # the outcome, as scored
    estimator = get_advantage_estimator("grpo-no-std")
    advantages, _ = estimator(
        shaped.token_rewards, shaped_batch.response_mask, group_size=4, row_valid=shaped.trains
    )
    # The baseline is the mean of the three others (1/3), not of all four (1/2).
    per_row = [float(advantages[r, 0]) for r in (0, 1, 3)]
    assert per_row == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-6)
    assert float(advantages[2].abs().sum()) == 0.0


def test_the_soft_penalty_joins_what_the_advantages_read_only() -> None:
    batch, rollout, rewards = _step([2, 7, 8], [True, True, False], [1.0, 1.0, 1.0])
    trainer = _trainer(8, buffer=4, penalty=1.0)
    shaped_batch, shaped, metrics = Trainer.overlong(trainer, batch, rollout, rewards)
    assert shaped_batch is batch  # nothing masked
    totals = shaped.token_rewards.sum(dim=1)
    torch.testing.assert_close(totals, torch.tensor([1.0, 0.25, 0.0]), rtol=0, atol=1e-7)
    assert shaped.scores.tolist() == [1.0, 1.0, 1.0]
    assert metrics["overlong/penalty_mean"] == pytest.approx(-1.75 / 3)


def test_off_by_default_the_step_is_untouched() -> None:
    batch, rollout, rewards = _step([2, 3], [True, False], [1.0, 0.0])
    shaped_batch, shaped, metrics = Trainer.overlong(_trainer(3), batch, rollout, rewards)
    assert (shaped_batch, shaped, metrics) == (batch, rewards, {})


def test_a_mismatch_no_dtype_explains_stops_the_run_in_one_line() -> None:
    trainer = _trainer(4)
    Trainer.check_mismatch(trainer, {"mismatch/kl": 0.002}, 3)  # bf16 against fp32: fine
    Trainer.check_mismatch(trainer, {}, 3)  # not measured (engine and learner agree)
    with pytest.raises(RlxError) as stop:
        Trainer.check_mismatch(trainer, {"mismatch/kl": 4.5}, 3)
    line = str(stop.value)
    assert "\n" not in line
    assert line.startswith("step 3: mismatch/kl 4.5 ")
    assert "algo.rollout_correction.max_mismatch_kl 1" in line
    never = AlgorithmSettings(rollout_correction={"max_mismatch_kl": None})
    off = SimpleNamespace(settings=SimpleNamespace(algo=never))
    Trainer.check_mismatch(off, {"mismatch/kl": 4.5}, 3)
