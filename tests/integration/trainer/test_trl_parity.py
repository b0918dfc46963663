"""One frozen GRPO batch through TRL's loss and through rlx's gives the same loss.

TRL's side is its own code path: GRPOTrainer.compute_loss (trl 1.16) on a real model and the
inputs dict its generation step builds. rlx's side is Learner.policy_loss, the loss the
update back-propagates. The settings that make the two the same objective:

  TRL (GRPOConfig)                       rlx (trainer section)
  loss_type="dapo": sum over the         algo.loss_agg: token-mean with the global token
    completion tokens / num_items_in_      count (the Learner divides every micro-batch by
    batch (all of the step's tokens)       the minibatch's token count over all ranks)
  epsilon=0.2 (epsilon_high = epsilon)   algo.clip_eps: 0.2 (clip_eps_high unset)
  beta=0.04, KL added per token          algo.kl: {coef: 0.04, estimator: k3, mode: loss}
    (exp(ref - logp) - (ref - logp) - 1,
    TRL's estimator: k3)
  use_bias_correction_kl=False: plain    (k3 as is; TRL's default multiplies the KL by
    k3                                   the ratio, which changes value and gradient
                                         once old and new log-probs differ)
  advantages (B,), one per completion    advantages broadcast over the response tokens
  old_per_token_logps, ref_per_token_    fields old_logp and ref_logp, (B, R)
    logps
  temperature=1.0, entropy_coef=0        rollout.temperature: 1.0, algo.entropy_coef: 0

The batch has prompts of several lengths (left padding), prompts shared by several rows
(rlx then runs each distinct prompt once), responses of several lengths (right padding),
advantages of both signs and old log-probs far enough from the current ones that some
tokens are clipped and some are not. The gradients of the two losses agree as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlx.trainer import algos
from rlx.trainer.batch import ADVANTAGES, OLD_LOGP, REF_LOGP, SequenceBatch
from rlx.trainer.learn.learner import Learner
from tests.support.recipes import make_recipe

trl = pytest.importorskip(
    "trl", reason="trl is not installed: pip install trl to compare with TRL's GRPO loss"
)

pytestmark = pytest.mark.timeout(300)

BETA = 0.04
CLIP_EPS = 0.2
PAD = 259  # the tiny tokenizer's <|pad|>

# (prompt, response) token ids; the first two prompts come back for several responses.
PROMPT_A = [257, 117, 115, 101, 114, 10, 87, 114, 105, 116, 101]
PROMPT_B = [257, 117, 115, 101, 114, 10, 72, 105]
SAMPLES = [
    (PROMPT_A, [49, 50, 51, 52, 53, 54, 258]),
    (PROMPT_A, [97, 98, 99, 100, 101, 102, 103, 104, 105]),
    (PROMPT_A, [120, 121, 258]),
    (PROMPT_B, [48, 48, 49, 258]),
    (PROMPT_B, [65, 66, 67, 68, 69, 70, 71, 72, 73]),
    (PROMPT_B, [32, 33, 34, 35, 36]),
    ([257, 97], [111, 112, 113, 114, 258]),
    ([257, 122, 122, 122, 122, 122, 122, 122, 122, 122, 122, 122], [50, 51]),
]
ADVANTAGE_VALUES = [1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 0.6, -0.4]


def frozen_inputs() -> dict[str, torch.Tensor]:
    """Prompts left-padded, completions right-padded, as TRL's generation step lays them out."""
    prompt_width = max(len(p) for p, _ in SAMPLES)
    response_width = max(len(r) for _, r in SAMPLES)
    rows = len(SAMPLES)
    prompt_ids = torch.full((rows, prompt_width), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    completion_ids = torch.full((rows, response_width), PAD, dtype=torch.long)
    completion_mask = torch.zeros((rows, response_width), dtype=torch.long)
    for row, (prompt, response) in enumerate(SAMPLES):
        prompt_ids[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, prompt_width - len(prompt) :] = 1
        completion_ids[row, : len(response)] = torch.tensor(response)
        completion_mask[row, : len(response)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGE_VALUES),
    }


def as_sequence_batch(inputs: dict[str, torch.Tensor]) -> SequenceBatch:
    mask = inputs["completion_mask"].bool()
    advantages = algos.broadcast_to_tokens(inputs["advantages"], mask)  # (B, R)
    return SequenceBatch(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        response_mask=mask,
        prompt_width=inputs["prompt_ids"].shape[1],
        fields={
            ADVANTAGES: advantages,
            OLD_LOGP: inputs["old_per_token_logps"],
            REF_LOGP: inputs["ref_per_token_logps"],
        },
    )


def rlx_learner(tmp_path: Path, model_dir: Path) -> Learner:
    trainer = make_recipe(
        tmp_path,
        model={"path": str(model_dir), "dtype": "float32"},
        rollout={"n": 3, "max_new_tokens": 16, "temperature": 1.0},
        algo={
            "clip_eps": CLIP_EPS,
            "kl": {"coef": BETA, "estimator": "k3", "mode": "loss"},
            "loss_agg": "token-mean",
            "entropy_coef": 0.0,
        },
        batch={"prompts_per_step": 1, "micro_batch_size": len(SAMPLES)},
    ).trainer
    assert trainer is not None
    return Learner(trainer, str(model_dir), None, torch.device("cpu"))


def trl_trainer(tmp_path: Path, model_dir: Path):
    from datasets import Dataset

    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        loss_type="dapo",
        beta=BETA,
        epsilon=CLIP_EPS,
        use_bias_correction_kl=False,
        temperature=1.0,
        per_device_train_batch_size=len(SAMPLES),
        num_generations=2,
        max_completion_length=16,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
    )

    def reward(completions: list, **_: object) -> list[float]:
        return [0.0 for _ in completions]

    dataset = Dataset.from_list([{"prompt": "unused"}] * 4)
    return trl.GRPOTrainer(
        model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset
    )


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_one_frozen_batch_gives_the_same_loss_in_trl_and_rlx(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    torch.manual_seed(0)
    learner = rlx_learner(tmp_path, tiny_model_dir)
    trainer = trl_trainer(tmp_path, tiny_model_dir)
    inputs = frozen_inputs()
    mask = inputs["completion_mask"].bool()

    # Old log-probs: the current ones moved by up to +-0.4, so that the ratio leaves the clip
    # range on some tokens and not on others; reference ones by up to +-1.5, so that the KL
    # term weighs in the loss. Zero on padding, as generated.
    batch = as_sequence_batch(
        {
            **inputs,
            "old_per_token_logps": torch.zeros(mask.shape),
            "ref_per_token_logps": torch.zeros(mask.shape),
        }
    )
    with torch.no_grad():
        current = learner._scores(learner.policy_scorer, batch, entropy_grad=False).logprobs
    generator = torch.Generator().manual_seed(1)
    shift_old = (torch.rand(mask.shape, generator=generator) - 0.5) * 0.8
    shift_ref = (torch.rand(mask.shape, generator=generator) - 0.5) * 3.0
    inputs["old_per_token_logps"] = torch.where(mask, current + shift_old, 0.0)
    inputs["ref_per_token_logps"] = torch.where(mask, current + shift_ref, 0.0)
    ratio = torch.exp(-shift_old)[mask]
    clipped = (ratio - 1).abs() > CLIP_EPS
    assert clipped.any() and (~clipped).any()  # the batch exercises the clip both ways

    # TRL: its compute_loss on the inputs dict, in training mode with one micro-batch per
    # optimiser step (what Trainer sets before calling it).
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    trl_inputs = {**inputs, "num_items_in_batch": mask.sum()}
    trl_loss = trainer.compute_loss(model, trl_inputs)
    trl_loss.backward()

    # rlx: the Learner's loss with the minibatch's global counts.
    learner.policy.train()
    tokens, seqs = algos.loss_denominators(mask)
    rlx_loss, pieces = learner.policy_loss(as_sequence_batch(inputs), tokens, seqs)
    rlx_loss.backward()

    trl_value, rlx_value = trl_loss.detach().item(), rlx_loss.detach().item()
    difference = abs(trl_value - rlx_value)
    print(f"TRL loss {trl_value:.9f}  rlx loss {rlx_value:.9f}  difference {difference:.2e}")
    assert float(pieces["loss/kl"]) > 0
    assert difference < 1e-5

    want, got = gradients(model), gradients(learner.policy)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5 * scale)
