"""Dynamic sampling's parts: which groups vary, the groups picked across rounds in order
(unvaried ones only to fill a short step), and one rollout of them with every field."""

from __future__ import annotations

import torch

from rlx.trainer.batch import RolloutBatch, join_groups
from rlx.trainer.filtering import Round, group_spread, pick_groups


def test_a_group_varies_beyond_the_tolerance_counting_valid_rows_only() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-9, 0.5, 0.0, 1.0, 0.0])
    varied = group_spread(scores, group_size=3, tolerance=1e-6)
    assert varied.tolist() == [False, True, False, True]
    # The last group's one different row failed: what is left does not vary; a group with a
    # single valid row has no spread at all.
    valid = torch.tensor([True] * 9 + [True, False, True])
    assert group_spread(scores, 3, 1e-6, valid).tolist() == [False, True, False, False]
    one = torch.tensor([True, False, False] * 4)
    assert not group_spread(scores, 3, 1e-6, one).any()


def _rollout(version: int, lengths: list[int], n: int = 2, episodes: bool = False) -> RolloutBatch:
    width = max(lengths)
    ids = torch.full((len(lengths), width), 0)
    mask = torch.zeros((len(lengths), width), dtype=torch.bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.arange(1, length + 1) + 100 * version + 10 * row
        mask[row, :length] = True
    return RolloutBatch(
        prompt_ids=[[version, row] for row in range(len(lengths))],
        response_ids=ids,
        response_mask=mask,
        logprobs=torch.where(mask, -0.5, 0.0),
        finished=torch.tensor([length < 4 for length in lengths]),
        n=n,
        pad_token_id=0,
        weight_version=version,
        loss_mask=mask.clone() if episodes else None,
        token_rewards=torch.where(mask, 0.25, 0.0) if episodes else None,
        episodes=[f"episode {version}.{row}" for row in range(len(lengths))] if episodes else None,
    )


def test_join_keeps_every_field_of_the_groups_picked_in_order() -> None:
    first, second = _rollout(3, [2, 3, 1, 1], episodes=True), _rollout(4, [4, 1], episodes=True)
    joined = join_groups([(second, 0), (first, 1)])
    assert len(joined) == 4 and joined.n == 2
    assert joined.prompt_ids == [[4, 0], [4, 1], [3, 2], [3, 3]]
    assert joined.response_ids.shape == (4, 4)  # padded to the longest
    assert joined.response_ids[0].tolist() == second.response_ids[0].tolist()
    assert joined.response_ids[2].tolist() == [first.response_ids[2, 0].item(), 0, 0, 0]
    assert joined.response_mask.sum(dim=1).tolist() == [4, 1, 1, 1]
    assert joined.loss_mask is not None and joined.loss_mask.equal(joined.response_mask)
    assert joined.token_rewards is not None
    assert float(joined.token_rewards.sum()) == 0.25 * 7
    assert joined.finished.tolist() == [False, True, True, True]
    assert joined.row_versions.tolist() == [4, 4, 3, 3] and joined.weight_version == 3
    assert joined.episodes == ["episode 4.0", "episode 4.1", "episode 3.2", "episode 3.3"]


def _round(version: int, rows: list[int], scores: list[float], varied: list[bool]) -> Round:
    rollout = _rollout(version, [1 + i % 3 for i in range(2 * len(rows))])
    return Round(rows, rollout, torch.tensor(scores), torch.tensor(varied))


def test_picks_the_first_varied_groups_of_the_rounds_in_order() -> None:
    rounds = [
        _round(1, [10, 11, 12], [0, 1, 1, 1, 0, 0], [True, False, False]),
        _round(2, [20, 21, 22], [1, 1, 1, 0, 0, 1], [False, True, True]),
        _round(3, [30, 31, 32], [0, 1, 1, 0, 0, 1], [True, True, True]),
    ]
    picked = pick_groups(rounds, 3)
    assert picked.rows == [10, 21, 22]
    assert picked.scores.tolist() == [0, 1, 1, 0, 0, 1]
    assert (picked.kept, picked.dropped, picked.rounds, picked.short) == (3, 6, 3, False)
    assert picked.rollout.prompt_ids == [[1, 0], [1, 1], [2, 2], [2, 3], [2, 4], [2, 5]]


def test_a_short_step_is_filled_with_unvaried_groups_and_says_so() -> None:
    rounds = [
        _round(1, [10, 11], [1, 1, 0, 1], [False, True]),
        _round(2, [20, 21], [0, 0, 1, 1], [False, False]),
    ]
    picked = pick_groups(rounds, 2)
    assert picked.rows == [11, 10]  # the varied group first, then the first unvaried
    assert (picked.kept, picked.dropped, picked.short) == (1, 2, True)
