from __future__ import annotations

import pytest
import torch

from rlx.trainer.batch import (
    RolloutBatch,
    concat_rollouts,
    outcome_token_rewards,
    pack_rollout,
    pad_responses,
    split_evenly,
)

PAD = 9


def rollout(prompts: list[list[int]], responses: list[list[int]], n: int = 1) -> RolloutBatch:
    ids, mask, logprobs = pad_responses(responses, [[-0.5] * len(r) for r in responses], PAD)
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=ids,
        response_mask=mask,
        logprobs=logprobs,
        finished=torch.zeros(len(prompts), dtype=torch.bool),
        n=n,
        pad_token_id=PAD,
        weight_version=0,
    )


def test_pack_left_pads_prompts_and_keeps_responses_at_one_column() -> None:
    batch = pack_rollout(rollout([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]))
    assert batch.prompt_width == 3
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6, PAD], [PAD, PAD, 4, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions count real tokens only, as generate gave them
    assert batch.position_ids[1].tolist()[2:] == [0, 1, 2, 3]
    assert batch.response_ids.tolist() == [[5, 6, PAD], [7, 8, 9]]
    assert batch.num_tokens == 9


def test_trimmed_drops_all_padding_columns_and_fields_follow() -> None:
    batch = pack_rollout(rollout([[1, 2, 3], [4], [5]], [[5, 6], [7], [8, 8, 8, 8]]))
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    part = batch.with_fields(values=values).select([1])  # prompt [4], response [7]
    trimmed = part.trimmed()
    assert trimmed.input_ids.tolist() == [[4, 7]]
    assert trimmed.prompt_width == 1
    assert trimmed.response_mask.tolist() == [[True]]
    assert trimmed.fields["values"].tolist() == [[4.0]]
    assert trimmed.position_ids.tolist() == [[0, 1]]


def test_select_chunks_and_with_fields_checks_shapes() -> None:
    batch = pack_rollout(rollout([[1]] * 5, [[2, 3]] * 5))
    assert [len(c) for c in batch.chunks(2)] == [2, 2, 1]
    with pytest.raises(ValueError, match="field 'bad'"):
        batch.with_fields(bad=torch.zeros(5, 3))


def test_concat_rollouts_keeps_engine_order_and_repads() -> None:
    a = rollout([[1], [1]], [[5], [6]], n=2)
    b = rollout([[2], [2]], [[7, 7, 7], [8]], n=2)
    joined = concat_rollouts([a, b])
    assert joined.prompt_ids == [[1], [1], [2], [2]]
    assert joined.response_lists() == [[5], [6], [7, 7, 7], [8]]
    assert joined.response_ids.shape == (4, 3)
    assert joined.logprobs[2].tolist() == [-0.5, -0.5, -0.5]


def test_outcome_rewards_sit_on_the_last_real_token() -> None:
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


def test_split_evenly() -> None:
    assert [list(r) for r in split_evenly(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in split_evenly(2, 3)] == [1, 1, 0]
