"""The Learner without Ray: the update's gradient does not depend on how the minibatch is cut
(micro-batches, DDP ranks), old log-probs are only recomputed when needed, and the state a
checkpoint holds puts a learner back exactly."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from rlx.trainer.batch import ADVANTAGES, BEHAV_LOGP, OLD_LOGP, REF_LOGP, RETURNS, VALUES
from rlx.trainer.checkpoint.training import load_learner_state, save_learner_state
from rlx.trainer.learn.learner import Learner, merge_update_stats, needs_old_logprobs
from rlx.trainer.learn.models import lr_multiplier
from tests.support.gradients import assert_same_gradient, gradient_of_update
from tests.support.recipes import small_trainer

pytestmark = pytest.mark.timeout(300)


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    ("loss_agg", "policy_loss"),
    [
        ("token-mean", "ppo"),
        ("seq-mean-token-mean", "ppo"),
        ("seq-mean-token-sum", "ppo"),
        ("seq-mean-token-sum-norm", "ppo"),
        ("seq-mean-token-mean", "gspo"),
        ("token-mean", "cispo"),
    ],
)
def test_micro_batches_do_not_change_the_update(
    tmp_path, tiny_model_dir, advantage_batch, loss_agg, policy_loss, packing
):
    gradients = []
    for micro in (16, 5, 1):
        conf = small_trainer(
            tmp_path,
            batch={"micro_batch_size": micro, "packing": packing},
            algo={"loss_agg": loss_agg, "policy_loss": policy_loss},
            optim={"grad_clip": 1e9},
        )
        learner = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
        gradients.append(gradient_of_update(learner, advantage_batch))
    for other in gradients[1:]:
        assert_same_gradient(other, gradients[0])


def test_old_logprobs_are_recomputed_only_when_the_policy_moves_first(tmp_path) -> None:
    assert not needs_old_logprobs(small_trainer(tmp_path), ahead=False)
    assert needs_old_logprobs(small_trainer(tmp_path), ahead=True)
    assert needs_old_logprobs(small_trainer(tmp_path, batch={"ppo_epochs": 2}), ahead=False)
    assert needs_old_logprobs(small_trainer(tmp_path, batch={"minibatch_size": 8}), ahead=False)
    kl_reward = small_trainer(tmp_path, algo={"kl": {"coef": 0.1, "mode": "reward"}})
    assert needs_old_logprobs(kl_reward, ahead=False)
    kl_loss = small_trainer(tmp_path, algo={"kl": {"coef": 0.1, "mode": "loss"}})
    assert not needs_old_logprobs(kl_loss, ahead=False)


def test_one_update_without_old_logprobs_has_ratio_one(tmp_path, tiny_model_dir, advantage_batch):
    learner = Learner(small_trainer(tmp_path), str(tiny_model_dir), None, torch.device("cpu"))
    stats = merge_update_stats([learner.update(advantage_batch, step=1)])
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clipfrac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats["grad_norm"] > 0 and stats["entropy"] > 0


def test_the_recipe_chooses_the_policy_loss(tmp_path, tiny_model_dir, advantage_batch):
    # At ratio 1 PPO's and CISPO's gradients agree (-A grad log pi) but their values do not:
    # PPO's loss is -A x 1, CISPO's -A x log pi. The reported loss says which one ran.
    losses = {}
    for name in ("ppo", "cispo"):
        conf = small_trainer(tmp_path, algo={"policy_loss": name})
        learner = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
        losses[name] = merge_update_stats([learner.update(advantage_batch, step=1)])
    assert losses["ppo"]["grad_norm"] == pytest.approx(losses["cispo"]["grad_norm"], rel=1e-4)
    assert losses["ppo"]["loss/policy"] != pytest.approx(losses["cispo"]["loss/policy"], rel=1e-2)


def test_prepare_and_several_epochs_with_kl_and_critic(tmp_path, tiny_model_dir, advantage_batch):
    conf = small_trainer(
        tmp_path,
        algorithm="ppo",
        algo={"kl": {"coef": 0.05, "mode": "loss"}},
        batch={"ppo_epochs": 2, "minibatch_size": 8, "micro_batch_size": 4},
    )
    learner = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    extra = learner.prepare(advantage_batch, old_logprobs=True)
    assert set(extra) == {REF_LOGP, VALUES, OLD_LOGP}
    mask = advantage_batch.response_mask
    # Nothing has moved yet: old and reference log-probs agree, the value head starts at 0.
    torch.testing.assert_close(extra[OLD_LOGP], extra[REF_LOGP])
    assert torch.all(extra[VALUES] == 0)
    assert torch.all(extra[OLD_LOGP][mask] < 0) and torch.all(extra[OLD_LOGP][~mask] == 0)
    returns = torch.where(mask, 1.0, 0.0)
    batch = advantage_batch.with_fields(**extra, **{RETURNS: returns})
    stats = merge_update_stats([learner.update(batch, step=1)])
    assert stats["loss/value"] > 0 and stats["critic/grad_norm"] > 0
    assert stats["kl"] >= 0 and "loss/kl" in stats
    after = learner.prepare(advantage_batch, old_logprobs=True)
    assert float(after[VALUES][mask].mean()) > 0  # the critic moved toward the returns
    assert not torch.equal(after[OLD_LOGP], extra[OLD_LOGP])


def test_state_parts_restore_a_learner_exactly(tmp_path, tiny_model_dir, advantage_batch):
    conf = small_trainer(tmp_path, algorithm="ppo")
    first = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    batch = advantage_batch.with_fields(
        **first.prepare(advantage_batch, old_logprobs=False),
        **{RETURNS: torch.where(advantage_batch.response_mask, 0.5, 0.0)},
    )
    first.update(batch, step=1)
    second = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    save_learner_state(first.sharded_state(), tmp_path / "learner")
    state = second.sharded_state()
    load_learner_state(state, tmp_path / "learner")
    second.load_sharded_state(state)
    second.load_parts(copy.deepcopy(first.state_parts()))  # as if through a file
    first.update(batch, step=2)
    second.update(batch, step=2)
    for name, tensor in first.policy.state_dict().items():
        assert torch.equal(second.policy.state_dict()[name], tensor), name
    for name, tensor in first.critic.state_dict().items():
        assert torch.equal(second.critic.state_dict()[name], tensor), name


def test_lr_schedules() -> None:
    assert lr_multiplier(0, warmup_steps=3, total_steps=10, schedule="constant") == 0.25
    assert lr_multiplier(3, warmup_steps=3, total_steps=10, schedule="constant") == 1.0
    assert lr_multiplier(3, warmup_steps=3, total_steps=13, schedule="cosine") == 1.0
    assert lr_multiplier(8, warmup_steps=3, total_steps=13, schedule="cosine") == pytest.approx(0.5)
    assert lr_multiplier(13, warmup_steps=3, total_steps=13, schedule="linear") == 0.0


def test_optimiser_state_moves_away_and_back_whole(tmp_path, tiny_model_dir, advantage_batch):
    """What a colocated GPU worker does before its engine wakes: every AdamW moment of the
    policy and the critic leaves the training device (here: to "meta", a device other than
    the CPU that needs no accelerator), the step counters stay."""
    conf = small_trainer(tmp_path, algorithm="ppo")
    learner = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    extra = learner.prepare(advantage_batch, old_logprobs=True)
    returns = torch.where(advantage_batch.response_mask, 1.0, 0.0)
    learner.update(advantage_batch.with_fields(**extra, **{RETURNS: returns}), step=1)
    assert learner.move_optimizer_state("cpu") == 0  # already there: nothing moves
    params = sum(p.numel() for o in (learner.optimizer, learner.critic_optimizer) for p in o.state)
    moved = learner.move_optimizer_state("meta")
    assert moved == 2 * params * 4  # both AdamW moments of every trained parameter, float32
    for o in (learner.optimizer, learner.critic_optimizer):
        for state in o.state.values():
            assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
            assert not state["step"].is_meta  # the step counter stays where it is


def _engine_logp(tmp_path, tiny_model_dir, batch, shift_row: int, shift: float) -> torch.Tensor:
    """The learner's own old log-probs, as an engine that agreed everywhere but on one
    response would have returned them (that response's tokens `shift` higher)."""
    plain = Learner(small_trainer(tmp_path), str(tiny_model_dir), None, torch.device("cpu"))
    old = plain.prepare(batch, old_logprobs=True)[OLD_LOGP]  # (B, R)
    engine = old.clone()
    engine[shift_row] += shift
    return torch.where(batch.response_mask, engine, 0.0)


def test_a_masked_response_drops_out_and_the_mismatch_is_measured(
    tmp_path, tiny_model_dir, advantage_batch
) -> None:
    # Response 0's weight is e^-0.5 = 0.61 on every token, outside [0.9, 1.1]: masked, its
    # gradient is that of the same batch with its advantages zeroed. The rest agree exactly.
    engine = _engine_logp(tmp_path, tiny_model_dir, advantage_batch, 0, 0.5)
    batch = advantage_batch.with_fields(**{BEHAV_LOGP: engine})
    mask = {"on": True, "action": "mask", "low": 0.9, "high": 1.1}
    conf = small_trainer(tmp_path, algo={"rollout_correction": mask}, optim={"grad_clip": 1e9})
    masked = gradient_of_update(
        Learner(conf, str(tiny_model_dir), None, torch.device("cpu")), batch
    )
    advantages = batch.fields[ADVANTAGES].clone()
    advantages[0] = 0.0
    plain_conf = small_trainer(tmp_path, optim={"grad_clip": 1e9})
    want = gradient_of_update(
        Learner(plain_conf, str(tiny_model_dir), None, torch.device("cpu")),
        advantage_batch.with_fields(**{ADVANTAGES: advantages}),
    )
    assert_same_gradient(masked, want)

    learner = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
    stats = merge_update_stats([learner.update(batch, step=1)])
    tokens = batch.response_mask.sum()
    share = float(batch.response_mask[0].sum() / tokens)
    assert stats["mismatch/masked_fraction"] == pytest.approx(share, abs=1e-6)
    assert stats["mismatch/max_abs_logprob_diff"] == pytest.approx(0.5, abs=1e-5)
    assert stats["mismatch/kl"] > 0
    assert stats["mismatch/weight_mean"] == pytest.approx(
        1 - share * (1 - math.exp(-0.5)), abs=1e-5
    )


def test_correction_off_still_measures_and_weighs_nothing(
    tmp_path, tiny_model_dir, advantage_batch
) -> None:
    engine = _engine_logp(tmp_path, tiny_model_dir, advantage_batch, 0, 0.5)
    batch = advantage_batch.with_fields(**{BEHAV_LOGP: engine})
    conf = small_trainer(tmp_path, algo={"rollout_correction": {"on": False}})
    stats = merge_update_stats(
        [Learner(conf, str(tiny_model_dir), None, torch.device("cpu")).update(batch, step=1)]
    )
    assert stats["mismatch/kl"] > 0 and "mismatch/weight_mean" not in stats


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_step_with_every_token_masked_updates_nothing(
    tmp_path, tiny_model_dir, advantage_batch, packing
) -> None:
    # Every response cut at the limit and masked (algo.overlong.mask_truncated): the passes
    # still run the model, so the loss stays in the graph and the gradient is exactly zero.
    batch = replace(advantage_batch, response_mask=torch.zeros_like(advantage_batch.response_mask))
    conf = small_trainer(tmp_path, batch={"micro_batch_size": 5, "packing": packing})
    learner = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
    before = params(learner)
    stats = merge_update_stats([learner.update(batch, step=1)])
    assert stats["grad_norm"] == 0.0
    after = params(learner)
    assert all(torch.equal(before[name], after[name]) for name in before)
