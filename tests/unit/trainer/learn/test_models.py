"""The scoring forward: rows that share a prompt run it once, with the result of a full
forward (log-probs, entropies and gradients) up to float rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.trainer.batch import SequenceBatch, pack_rollout
from rlx.trainer.learn.scoring import ResponseScorer, score_responses
from rlx.trainer.model.prefill import prompt_groups
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.hf import HFEngine

pytestmark = pytest.mark.timeout(300)

# Unequal lengths (left padding differs per prompt); each prompt is sampled 3 times.
PROMPTS = [[256, 72, 105], [256, 65, 66, 67, 68, 69, 70], [256, 49]]


@pytest.fixture(scope="module")
def grouped_batch(tiny_model_dir: Path) -> SequenceBatch:
    rollout = HFEngine(tiny_model_dir).generate(PROMPTS, SamplingArgs(3, max_new_tokens=10), seed=0)
    return pack_rollout(rollout)


def full_forward(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """(B, R, V): every row's whole sequence through the model, nothing shared."""
    width = batch.response_mask.shape[1]
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits
    return logits[:, -width - 1 : -1]


def test_prompt_groups_finds_the_rows_of_each_prompt() -> None:
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [1, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    groups = prompt_groups(ids, mask)
    assert groups is not None
    first, inverse = groups
    assert len(first) == 3
    for row in range(len(ids)):
        assert torch.equal(ids[first[inverse[row]]], ids[row])
        assert torch.equal(mask[first[inverse[row]]], mask[row])
        assert first[inverse[row]] <= row  # the first row of its prompt
    assert prompt_groups(ids[:2], mask[:2]) is None  # nothing repeats: nothing to share


def test_shared_prompts_give_a_full_forwards_scores_and_gradients(
    tiny_model_dir: Path, grouped_batch: SequenceBatch
) -> None:
    batch = grouped_batch
    assert (
        prompt_groups(
            batch.input_ids[:, : batch.prompt_width], batch.attention_mask[:, : batch.prompt_width]
        )
        is not None
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()  # as in the update: the dropout-free tiny model, gradients on
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    mask = batch.response_mask

    def loss_and_grads(scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = (scores * weights)[mask].sum()
        loss.backward()
        return scores.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    scorer = ResponseScorer(model)
    assert scorer._can_share(batch)
    shared_scores = score_responses(scorer, batch, 1.0, entropy_grad=True)
    shared, shared_grads = loss_and_grads(shared_scores.logprobs + shared_scores.entropy)
    logits = full_forward(model, batch)  # (B, R, V)
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # (B, R)
    entropy = -(logp.exp() * logp).sum(-1)  # (B, R)
    full, full_grads = loss_and_grads(torch.where(mask, token_logp + entropy, 0.0))
    torch.testing.assert_close(shared[mask], full[mask], rtol=1e-4, atol=1e-4)
    scale = max(float(g.abs().max()) for g in full_grads.values())
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-3, atol=1e-5 * scale)
