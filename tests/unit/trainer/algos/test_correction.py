"""Rollout correction weights against hand-worked numbers, and the exactness of the correction:
with samples from an engine that differs from the learner, the corrected policy gradient's
expectation is the on-policy gradient, the uncorrected one's is not."""

import itertools
import math

import pytest
import torch

from rlx.trainer.algos import (
    CORRECTION_ACTIONS,
    CORRECTION_LEVELS,
    behavior_weights,
    correction_bounds_problem,
    ppo_policy_loss,
    rollout_correction_weights,
)

F64 = torch.float64


def _pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(learner, engine, mask) with learner / engine = ratios per token; NaN marks padding,
    where the log-probs hold NaN and inf as a careless caller's padding might."""
    rho = torch.tensor(ratios, dtype=F64)  # (B, T)
    mask = ~rho.isnan()
    engine = torch.full_like(rho, math.log(0.2))
    learner = torch.where(mask, engine + rho.log(), float("nan"))
    engine = torch.where(mask, engine, float("inf"))
    return learner, engine, mask


# ratios per token: row 0 = 2, 0.5, 4 (product 4); row 1 = 3 and padding
RATIOS = [[2.0, 0.5, 4.0], [3.0, float("nan"), float("nan")]]


def test_token_truncate_is_tis() -> None:
    learner, engine, mask = _pair(RATIOS)
    weight, metrics = rollout_correction_weights(learner, engine, mask, high=2.5)
    # min(rho, 2.5) per token; padding 0
    assert torch.allclose(weight, torch.tensor([[2.0, 0.5, 2.5], [2.5, 0.0, 0.0]], dtype=F64))
    # raw mean (2 + 0.5 + 4 + 3) / 4; square mean (4 + 0.25 + 16 + 9) / 4; 4 and 3 truncated
    assert metrics["mismatch/weight_mean"].item() == pytest.approx(2.375)
    assert metrics["mismatch/weight_sq_mean"].item() == pytest.approx(7.3125)
    assert metrics["mismatch/truncated_fraction"].item() == pytest.approx(0.5)
    assert not weight.requires_grad


def test_token_truncate_with_a_lower_bound() -> None:
    learner, engine, mask = _pair(RATIOS)
    weight, metrics = rollout_correction_weights(learner, engine, mask, low=0.8, high=2.5)
    # 0.5 is raised to 0.8 as well: 3 of 4 tokens changed
    assert torch.allclose(weight, torch.tensor([[2.0, 0.8, 2.5], [2.5, 0.0, 0.0]], dtype=F64))
    assert metrics["mismatch/truncated_fraction"].item() == pytest.approx(0.75)


def test_token_mask_is_icepop() -> None:
    learner, engine, mask = _pair(RATIOS)
    weight, metrics = rollout_correction_weights(
        learner, engine, mask, action="mask", low=0.4, high=2.5
    )
    # inside [0.4, 2.5] the weight stays, outside it is 0: 4 and 3 are dropped
    assert torch.allclose(weight, torch.tensor([[2.0, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    assert metrics["mismatch/masked_fraction"].item() == pytest.approx(0.5)
    assert "mismatch/truncated_fraction" not in metrics


def test_sequence_level_is_the_product() -> None:
    learner, engine, mask = _pair(RATIOS)
    weight, metrics = rollout_correction_weights(learner, engine, mask, level="sequence", high=3.5)
    # row 0: 2 * 0.5 * 4 = 4, truncated to 3.5 on each of its tokens; row 1: 3
    assert torch.allclose(weight, torch.tensor([[3.5, 3.5, 3.5], [3.0, 0.0, 0.0]], dtype=F64))
    # raw per token 4, 4, 4, 3 -> mean 3.75; the 3 tokens of row 0 truncated
    assert metrics["mismatch/weight_mean"].item() == pytest.approx(3.75)
    assert metrics["mismatch/truncated_fraction"].item() == pytest.approx(0.75)
    masked, metrics = rollout_correction_weights(
        learner, engine, mask, level="sequence", action="mask", low=0.5, high=3.5
    )
    # the whole of row 0 drops out
    assert torch.allclose(masked, torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0]], dtype=F64))
    assert metrics["mismatch/masked_fraction"].item() == pytest.approx(0.75)


def test_geometric_level_is_the_per_token_geometric_mean() -> None:
    learner, engine, mask = _pair(RATIOS)
    weight, _ = rollout_correction_weights(learner, engine, mask, level="geometric", high=10.0)
    # row 0: (2 * 0.5 * 4) ** (1/3) = 4 ** (1/3) = 1.587401; row 1: 3
    root = 4 ** (1 / 3)
    want = torch.tensor([[root, root, root], [3.0, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(weight, want)
    # a tight geometric mask (SkyRL's) keeps row 0 and drops row 1
    masked, metrics = rollout_correction_weights(
        learner, engine, mask, level="geometric", action="mask", low=0.5, high=2.0
    )
    assert torch.allclose(masked, torch.tensor([[root, root, root], [0.0] * 3], dtype=F64))
    assert metrics["mismatch/masked_fraction"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("action", sorted(CORRECTION_ACTIONS))
@pytest.mark.parametrize("level", sorted(CORRECTION_LEVELS))
def test_agreement_is_a_no_op_to_the_bit(level: str, action: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(4, 7, generator=gen)  # (B, T) float32, as a learner gives
    lengths = torch.tensor([7, 1, 4, 0])
    mask = torch.arange(7) < lengths.unsqueeze(-1)  # (B, T) ragged, one empty row
    logp = torch.where(mask, logp, float("nan"))  # padding is garbage
    weight, metrics = rollout_correction_weights(
        logp, logp.clone(), mask, level=level, action=action, low=1.0, high=1.0
    )
    assert torch.equal(weight, mask.float())  # exactly 1 on every valid token, 0 elsewhere
    assert metrics["mismatch/weight_mean"].item() == 1.0
    changed = "truncated_fraction" if action == "truncate" else "masked_fraction"
    assert metrics[f"mismatch/{changed}"].item() == 0.0


@pytest.mark.parametrize("action", sorted(CORRECTION_ACTIONS))
@pytest.mark.parametrize("level", sorted(CORRECTION_LEVELS))
def test_all_tokens_masked_gives_zeros_not_nan(level: str, action: str) -> None:
    learner, engine, _ = _pair(RATIOS)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    weight, metrics = rollout_correction_weights(
        learner, engine, mask, level=level, action=action, low=0.5, high=2.0
    )
    assert torch.equal(weight, torch.zeros(2, 3, dtype=F64))
    assert all(value.item() == 0.0 for value in metrics.values())


def test_one_token_responses_are_the_same_at_every_level() -> None:
    learner, engine, mask = _pair([[2.0], [0.3], [1.0]])
    weights = [
        rollout_correction_weights(learner, engine, mask, level=level, high=1.5)[0]
        for level in sorted(CORRECTION_LEVELS)
    ]
    want = torch.tensor([[1.5], [0.3], [1.0]], dtype=F64)
    for weight in weights:
        assert torch.allclose(weight, want)


def test_a_long_sequence_product_stays_finite() -> None:
    learner, engine, mask = _pair([[2.0] * 100])  # log of the product 69.3, past exp's range
    weight, metrics = rollout_correction_weights(learner, engine, mask, level="sequence", high=5)
    assert torch.equal(weight, torch.full((1, 100), 5.0, dtype=F64))
    assert all(math.isfinite(value.item()) for value in metrics.values())


def test_behavior_weights_are_the_token_level_truncation() -> None:
    gen = torch.Generator().manual_seed(1)
    proximal = -2 * torch.rand(3, 5, generator=gen)
    behaviour = proximal + 0.8 * torch.randn(3, 5, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    weight, metrics = behavior_weights(proximal, behaviour, mask, cap=1.5)
    same, general = rollout_correction_weights(proximal, behaviour, mask, high=1.5)
    assert torch.equal(weight, same)
    assert torch.equal(metrics["offpolicy/weight_mean"], general["mismatch/weight_mean"])
    assert torch.equal(metrics["offpolicy/truncated_frac"], general["mismatch/truncated_fraction"])


@pytest.mark.parametrize(("low", "high"), [(1.5, 2.0), (0.5, 0.9), (-0.1, 2.0)])
def test_bounds_that_exclude_one_are_refused(low: float, high: float) -> None:
    problem = correction_bounds_problem(low, high)
    assert problem is not None and "0 <= low <= 1 <= high" in problem
    learner, engine, mask = _pair(RATIOS)
    with pytest.raises(ValueError, match=r"low: 0\.5, high: 2\.0"):
        rollout_correction_weights(learner, engine, mask, low=low, high=high)
    assert correction_bounds_problem(0.5, 2.0) is None


def test_unknown_level_and_action_list_the_valid_ones() -> None:
    learner, engine, mask = _pair(RATIOS)
    with pytest.raises(ValueError, match="'geometric', 'sequence', 'token'"):
        rollout_correction_weights(learner, engine, mask, level="seq")
    with pytest.raises(ValueError, match="'mask', 'truncate'"):
        rollout_correction_weights(learner, engine, mask, action="reject")


# ---------------------------------------------------------------- exactness
#
# A one-step bandit over 4 tokens: the learner is pi = softmax(theta), the engine samples from
# mu = softmax(theta / 2), the same logits at temperature 2 (a deliberately different policy).
# The on-policy gradient of J = E_pi[r] is g = grad sum_y pi(y) r(y). Each sample's loss goes
# through the trainer's own functions: correction weight (token level, no truncation), PPO's
# loss at its first step (old_logp = logp, ratio 1), the token-mean aggregation.

THETA = [0.5, -0.3, 1.2, 0.0]
REWARD = [1.0, 0.0, -0.5, 2.0]
TEMPERATURE = 2.0


def _bandit() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    theta = torch.tensor(THETA, dtype=F64, requires_grad=True)
    engine_logp = torch.log_softmax(theta.detach() / TEMPERATURE, dim=-1)  # (V,) log mu
    on_policy = torch.autograd.grad(
        (torch.softmax(theta, -1) * torch.tensor(REWARD, dtype=F64)).sum(), theta
    )[0]  # (V,) g
    return theta, engine_logp, on_policy


def _loss_gradient(
    theta: torch.Tensor,
    engine_logp: torch.Tensor,
    tokens: torch.Tensor,
    coef: torch.Tensor,
    corrected: bool,
    high: float = math.inf,
) -> torch.Tensor:
    """grad of sum_i coef_i loss(token_i): coef = mu(y) enumerates, 1 / N averages samples."""
    logp = torch.log_softmax(theta, -1)[tokens].unsqueeze(-1)  # (B, 1)
    old_logp = logp.detach()
    mask = torch.ones_like(logp, dtype=torch.bool)
    advantages = torch.tensor(REWARD, dtype=F64)[tokens].unsqueeze(-1)  # (B, 1)
    weight = None
    if corrected:
        weight, _ = rollout_correction_weights(
            old_logp, engine_logp[tokens].unsqueeze(-1), mask, high=high
        )
    loss, _ = ppo_policy_loss(logp, old_logp, advantages, mask, behavior_weight=weight)
    return torch.autograd.grad((coef.unsqueeze(-1) * loss).sum(), theta)[0]


def test_corrected_expectation_is_the_on_policy_gradient_by_enumeration() -> None:
    theta, engine_logp, on_policy = _bandit()
    tokens = torch.arange(4)
    mu = engine_logp.exp()  # (V,) each token's probability under the engine
    corrected = _loss_gradient(theta, engine_logp, tokens, mu, corrected=True)
    # the loss is minimised: its gradient is minus the objective's
    assert torch.allclose(-corrected, on_policy, atol=1e-12)
    uncorrected = _loss_gradient(theta, engine_logp, tokens, mu, corrected=False)
    assert (-uncorrected - on_policy).norm() > 0.1 * on_policy.norm()  # negative control
    # truncation (TIS) trades this exactness for variance: biased where a weight is cut
    truncated = _loss_gradient(theta, engine_logp, tokens, mu, corrected=True, high=1.0)
    assert not torch.allclose(-truncated, on_policy, atol=1e-3)


def test_corrected_sample_mean_is_the_on_policy_gradient_within_sampling_error() -> None:
    theta, engine_logp, on_policy = _bandit()
    n = 200_000
    gen = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(engine_logp.exp(), n, replacement=True, generator=gen)  # (N,)
    pi = torch.softmax(theta.detach(), -1)  # (V,)
    reward = torch.tensor(REWARD, dtype=F64)
    onehot = torch.nn.functional.one_hot(tokens, 4).to(F64)  # (N, V)
    for corrected in (True, False):
        # token-mean over N one-token responses: the mean of the per-sample losses
        estimate = _loss_gradient(theta, engine_logp, tokens, torch.ones(n, dtype=F64), corrected)
        estimate = -estimate / n
        # each sample's gradient of w r log pi(y) is w r (onehot(y) - pi): its spread gives
        # the standard error of the mean, per component
        weight = (pi.log() - engine_logp)[tokens].exp() if corrected else torch.ones(n, dtype=F64)
        per_sample = (weight * reward[tokens]).unsqueeze(-1) * (onehot - pi)  # (N, V)
        assert torch.allclose(per_sample.mean(0), estimate, atol=1e-10)  # same quantity
        stderr = per_sample.std(0) / math.sqrt(n)  # (V,)
        z = ((estimate - on_policy).abs() / stderr).max()
        if corrected:
            assert z < 5, f"corrected estimate off by {z:.1f} standard errors"
        else:
            assert z > 20, f"uncorrected estimate only {z:.1f} standard errors off"


def test_sequence_level_weight_is_exact_where_the_token_level_is_not() -> None:
    # Two steps, the second token's logits depending on the first (16 responses): the
    # sequence weight prod_t pi / mu is the exact correction of the response's gradient; the
    # token weight of step 2 ignores that step 1 was sampled from mu, so it is biased.
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(5, 4, generator=gen, dtype=F64).requires_grad_()  # row 0: step 1
    reward = torch.randn(4, 4, generator=gen, dtype=F64)  # r(y1, y2)
    pairs = torch.tensor(list(itertools.product(range(4), range(4))))  # (16, 2)
    rows = torch.stack([torch.zeros(16, dtype=torch.long), 1 + pairs[:, 0]], -1)  # (16, 2)

    def logp_of(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, -1)[rows, pairs]  # (16, 2) per token

    logp = logp_of(theta)
    engine_logp = logp_of(theta.detach() / TEMPERATURE)
    seq_reward = reward[pairs[:, 0], pairs[:, 1]]  # (16,)
    on_policy = torch.autograd.grad((logp.sum(-1).exp() * seq_reward).sum(), theta)[0]
    mu = engine_logp.sum(-1).exp()  # (16,) each response's probability under the engine
    mask = torch.ones(16, 2, dtype=torch.bool)
    advantages = seq_reward.unsqueeze(-1).expand(16, 2)  # (16, 2)

    def expected_gradient(level: str) -> torch.Tensor:
        logp = logp_of(theta)
        weight, _ = rollout_correction_weights(
            logp.detach(), engine_logp, mask, level=level, high=math.inf
        )
        loss, _ = ppo_policy_loss(logp, logp.detach(), advantages, mask, behavior_weight=weight)
        # each response's loss is its tokens' sum, weighted by its probability under mu
        return -torch.autograd.grad((mu.unsqueeze(-1) * loss).sum(), theta)[0]

    sequence = expected_gradient("sequence")
    token = expected_gradient("token")
    assert torch.allclose(sequence, on_policy, atol=1e-12)
    assert (token - on_policy).norm() > 0.05 * on_policy.norm()
