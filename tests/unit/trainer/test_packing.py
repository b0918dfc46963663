"""The packer: every sequence in exactly one row, rows within their length, passes within the
budget, ranks' shares balanced, and packed rows that put each response token where the
position before it predicts it."""

from __future__ import annotations

import torch

from rlx.trainer.batch import RolloutBatch, pack_rollout, pad_responses
from rlx.trainer.packing import balanced_split, pack_bins, pack_rows, plan_passes

LENGTHS = [400, 7, 120, 33, 260, 90, 15, 300, 64, 5, 180, 41, 512, 700, 3, 77]


def test_rows_hold_every_sequence_once_within_their_length() -> None:
    rows = pack_bins(LENGTHS, 512)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(LENGTHS)))
    fills = [sum(LENGTHS[i] for i in row) for row in rows]
    for row, fill in zip(rows, fills, strict=True):
        assert fill <= 512 or len(row) == 1  # only a sequence longer than a row goes alone
    assert [r for r in rows if LENGTHS[r[0]] == 700] == [[13]]
    assert fills == sorted(fills, reverse=True)  # fullest first
    # few rows: no more than one beyond what the tokens need
    assert len(rows) <= -(-sum(LENGTHS) // 512) + 2


def test_rows_come_out_about_equally_full() -> None:
    lengths = [
        int(x) for x in torch.randint(20, 300, (64,), generator=torch.Generator().manual_seed(0))
    ]
    fills = [sum(lengths[i] for i in row) for row in pack_bins(lengths, 512)]
    assert max(fills) <= 512
    waste = sum(max(fills) - f for f in fills) / (max(fills) * len(fills))
    assert waste < 0.05, fills


def test_passes_keep_to_the_budget() -> None:
    for budget in (512, 1024, 2048, 5000):
        passes = plan_passes(LENGTHS, budget, 512)
        assert sorted(i for p in passes for row in p for i in row) == list(range(len(LENGTHS)))
        for rows in passes:
            widest = max(sum(LENGTHS[i] for i in row) for row in rows)
            assert widest * len(rows) <= budget or len(rows) == 1


def test_ranks_get_equal_counts_and_balanced_costs() -> None:
    costs = [float(n) for n in LENGTHS]
    shares = balanced_split(costs, 3)
    assert sorted(len(s) for s in shares) == [5, 5, 6]
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shares]
    consecutive = [sum(costs[i] for i in range(a, b)) for a, b in ((0, 6), (6, 11), (11, 16))]
    assert max(loads) - min(loads) < max(consecutive) - min(consecutive)
    assert max(loads) <= sum(costs) / 3 + max(costs)


def test_packed_rows_restart_positions_and_score_the_right_tokens() -> None:
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[11, 12], [13, 14, 15, 16], [17]]
    ids, mask, logprobs = pad_responses(responses, [[0.0] * len(r) for r in responses], 0)
    batch = pack_rollout(
        RolloutBatch(prompts, ids, mask, logprobs, torch.ones(3, dtype=torch.bool), 1, 0, 0)
    )
    packed = pack_rows(batch, [[1, 0], [2]])
    assert packed.input_ids.tolist() == [
        [8, 13, 14, 15, 16, 5, 6, 7, 11, 12],
        [9, 10, 17] + [0] * 7,
    ]
    assert packed.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 4],
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 6],  # the tail's padding: a segment of its own
    ]
    # each scored token's predictor sits right before it, in response_mask's order
    targets = packed.input_ids.flatten()[packed.score_index + 1]
    assert targets.tolist() == [11, 12, 13, 14, 15, 16, 17]
    assert packed.real_tokens == 13 and packed.positions == 20
