"""The loss variants papers use (GSPO, CISPO, Dr. GRPO's constant normaliser, REINFORCE++)
against hand-worked numbers, and the edge cases: all tokens masked, one-token responses,
groups without spread, a group of identical winners under leave-one-out."""

import math

import pytest
import torch

from rlx.trainer.algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)

F64 = torch.float64


def t(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------- GSPO


def _gspo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # row 0: token ratios 2 and 0.5 (log ratios +-log 2, mean 0: s = 1), padding absurd
    # row 1: log ratios 0.3, 0.1, 0.2 (mean 0.2: s = e^0.2 = 1.221403, past 1 + 0.2)
    logratio = t([math.log(2), -math.log(2), 50.0], [0.3, 0.1, 0.2])
    old_logp = torch.full_like(logratio, -1.0)
    logp = (old_logp + logratio).requires_grad_()
    advantages = t([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return logp, old_logp, advantages, mask


def test_gspo_clips_the_length_normalised_sequence_ratio() -> None:
    logp, old_logp, advantages, mask = _gspo_case()
    loss, metrics = gspo_policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2)
    # row 0: max(-1 * 1, -1 * 1) = -1 per token; row 1: max(-2 * 1.221403, -2 * 1.2) = -2.4
    assert torch.allclose(loss, t([-1.0, -1.0, 0.0], [-2.4, -2.4, -2.4]))
    loss.sum().backward()
    # GSPO-token: d/dlogp_t = -A * s where unclipped (row 0: -1 each), 0 in a clipped response
    assert torch.allclose(logp.grad, t([-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]))
    assert metrics["clipfrac"].item() == pytest.approx(3 / 5)  # row 1's 3 tokens of 5
    # sequence ratio per token: (1 + 1 + 3 e^0.2) / 5
    assert metrics["ratio_mean"].item() == pytest.approx((2 + 3 * math.exp(0.2)) / 5)


def test_gspo_token_gives_gspo_sequence_gradient_under_seq_mean_token_mean() -> None:
    # The per-token form, aggregated per sequence, has the gradient of GSPO's own objective
    # -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log ratio).
    gen = torch.Generator().manual_seed(0)
    logp = (-2 * torch.rand(4, 5, generator=gen, dtype=F64)).requires_grad_()
    old_logp = logp.detach() + 0.1 * torch.randn(4, 5, generator=gen, dtype=F64)
    mask = torch.arange(5) < torch.tensor([5, 1, 3, 4]).unsqueeze(-1)  # (B, T)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=F64)
    advantages = seq_adv.unsqueeze(-1).expand(4, 5)
    loss, _ = gspo_policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.05)
    ours = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-mean"), logp)[0]
    s = torch.where(mask, logp - old_logp, 0.0).sum(-1) / mask.sum(-1)  # (B,) log s_i
    s = s.exp()
    paper = -torch.minimum(s * seq_adv, s.clamp(0.95, 1.05) * seq_adv).mean()
    want = torch.autograd.grad(paper, logp)[0]
    assert torch.allclose(ours, want, atol=1e-12)
    assert want.abs().max() > 1e-3  # some response kept its gradient


def test_gspo_on_one_token_responses_is_ppo() -> None:
    logp = torch.log(t([1.1], [1.5], [0.5])).requires_grad_()
    advantages, mask = t([1.0], [2.0], [-1.0]), torch.ones(3, 1, dtype=torch.bool)
    gspo, _ = gspo_policy_loss(logp, torch.zeros_like(logp), advantages, mask)
    ppo, _ = ppo_policy_loss(logp, torch.zeros_like(logp), advantages, mask)
    assert torch.allclose(gspo, ppo)
    assert torch.allclose(
        torch.autograd.grad(gspo.sum(), logp)[0], torch.autograd.grad(ppo.sum(), logp)[0]
    )


# ---------------------------------------------------------------- CISPO


def test_cispo_keeps_a_gradient_on_every_token() -> None:
    # ratios 1.1 (inside), 1.5 (above 1.2), 0.5 (below 0.8); old log-prob log 0.5
    ratios = [1.1, 1.5, 0.5]
    old_logp = torch.full((1, 3), math.log(0.5), dtype=F64)
    logp = (old_logp + torch.log(t(ratios))).requires_grad_()  # log 0.55, log 0.75, log 0.25
    advantages, mask = t([1.0, 2.0, -1.0]), torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = cispo_policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2)
    # -A * sg(clip(r)) * log pi: weights 1.1, 1.2, 0.8
    want = t([-1.1 * math.log(0.55), -2 * 1.2 * math.log(0.75), 0.8 * math.log(0.25)])
    assert torch.allclose(loss, want)
    loss.sum().backward()
    # d/dlogp = -A * clip(r): the clipped tokens still learn, with bounded weight (PPO: 0, 0)
    assert torch.allclose(logp.grad, t([-1.1, -2.4, 0.8]))
    assert metrics["clipfrac"].item() == pytest.approx(2 / 3)
    assert metrics["ratio_mean"].item() == pytest.approx(3.1 / 3)  # (1.1 + 1.5 + 0.5) / 3
    with pytest.raises(ValueError, match="no dual clip"):
        cispo_policy_loss(logp, old_logp, advantages, mask, dual_clip_c=3.0)


def test_cispo_at_ratio_one_has_the_policy_gradient_of_ppo() -> None:
    gen = torch.Generator().manual_seed(1)
    logp = (-3 * torch.rand(2, 4, generator=gen, dtype=F64)).requires_grad_()
    advantages = torch.randn(2, 4, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    grads = []
    for name in ("ppo", "cispo"):
        loss, _ = get_policy_loss(name)(logp, logp.detach(), advantages, mask)
        grads.append(torch.autograd.grad(loss.sum(), logp)[0])
    assert torch.allclose(grads[0], grads[1])  # -A grad log pi on every valid token


# ---------------------------------------------------------------- every policy loss


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_all_tokens_masked_gives_zero_loss_and_gradient(name: str) -> None:
    logp = torch.tensor([[-1.0, float("nan")], [-2.0, 3.0]], dtype=F64, requires_grad=True)
    old_logp = t([-1.5, 0.0], [float("inf"), -1.0])
    mask = torch.zeros(2, 2, dtype=torch.bool)
    loss, metrics = get_policy_loss(name)(logp, old_logp, t([1.0, 1.0], [1.0, 1.0]), mask)
    assert torch.equal(loss, torch.zeros(2, 2, dtype=F64))
    for mode in sorted(AGGREGATIONS):
        scalar = aggregate_loss(loss, mask, mode, token_budget=4)
        assert scalar.item() == 0.0
        (grad,) = torch.autograd.grad(scalar, logp, retain_graph=True)
        assert torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(value.item()) for value in metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_behaviour_weight_scales_every_loss(name: str) -> None:
    logp, old_logp, advantages, mask = _gspo_case()
    weight = t([0.5, 2.0, 9.0], [1.0, 0.0, 3.0])
    plain, _ = get_policy_loss(name)(logp, old_logp, advantages, mask)
    weighted, _ = get_policy_loss(name)(logp, old_logp, advantages, mask, behavior_weight=weight)
    assert torch.allclose(weighted, torch.where(mask, weight * plain, 0.0))


# ---------------------------------------------------------------- Dr. GRPO's normaliser


def test_seq_mean_token_sum_norm_by_hand() -> None:
    loss = t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # token sums 6 and 4 over the budget 8, averaged over the 2 sequences: (0.75 + 0.5) / 2
    mode = "seq-mean-token-sum-norm"
    assert aggregate_loss(loss, mask, mode, token_budget=8).item() == pytest.approx(0.625)
    # the global sequence count replaces the local one: (10 / 8) / 5
    assert aggregate_loss(
        loss, mask, mode, num_global_seqs=5, token_budget=8
    ).item() == pytest.approx(0.25)
    # the same responses padded further: a constant normaliser does not see the padding
    padded = torch.nn.functional.pad(loss, (0, 4), value=7.0)
    padded_mask = torch.nn.functional.pad(mask, (0, 4))
    assert aggregate_loss(padded, padded_mask, mode, token_budget=8).item() == pytest.approx(0.625)
    with pytest.raises(ValueError, match="pass token_budget"):
        aggregate_loss(loss, mask, mode)


# ---------------------------------------------------------------- REINFORCE++


def _whiten(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)  # unbiased, as masked_var
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_batch_baseline_by_hand() -> None:
    # outcome on the last token; gamma 0.5: row 0 returns (0.5, 1), row 1 (2), row 2 (0, 0)
    rewards = t([0.0, 1.0], [2.0, 0.0], [0.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    advantages, returns = reinforce_pp_advantages(rewards, mask, baseline="batch", gamma=0.5)
    assert torch.allclose(returns, t([0.5, 1.0], [2.0, 0.0], [0.0, 0.0]))
    a = _whiten([0.5, 1.0, 2.0, 0.0, 0.0])  # over the batch's 5 tokens
    assert torch.allclose(advantages, t([a[0], a[1]], [a[2], 0.0], [a[3], a[4]]))


def test_reinforce_pp_group_baseline_by_hand() -> None:
    # 2 prompts x 2 responses; scores 1, 0 | 1, 1 -> group means 0.5 and 1
    rewards = t([0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    advantages, _ = reinforce_pp_advantages(rewards, mask, baseline="group", group_size=2)
    # returns minus the group mean per token: (0.5, 0.5), (-0.5), (0), (0, 0), then whitened
    a = _whiten([0.5, 0.5, -0.5, 0.0, 0.0, 0.0])
    assert torch.allclose(advantages, t([a[0], a[1]], [a[2], 0.0], [a[3], 0.0], [a[4], a[5]]))


def test_reinforce_pp_invalid_rows_move_nothing() -> None:
    # row 1 failed (no mask, a garbage score): the group mean is row 0's alone
    rewards = t([0.0, 1.0], [0.0, 50.0], [1.0, 0.0], [0.0, 0.0])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    valid = torch.tensor([True, False, True, True])
    advantages, _ = reinforce_pp_advantages(
        rewards, mask, baseline="group", group_size=2, row_valid=valid
    )
    a = _whiten([0.0, 0.0, 0.5, -0.5, -0.5])  # row 0: 1 - 1; rows 2, 3: +-0.5 about 0.5
    assert torch.allclose(advantages, t([a[0], a[1]], [0.0, 0.0], [a[2], 0.0], [a[3], a[4]]))


def test_reinforce_pp_is_in_the_table() -> None:
    rewards = t([0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    for name, baseline in (("reinforce_pp", "batch"), ("reinforce_pp-baseline", "group")):
        got = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=2, gamma=0.9)
        want = reinforce_pp_advantages(rewards, mask, baseline=baseline, group_size=2, gamma=0.9)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="'batch', 'group'"):
        reinforce_pp_advantages(rewards, mask, baseline="prompt")


# ---------------------------------------------------------------- edge cases of the table


@pytest.mark.parametrize("name", ["grpo", "grpo-no-std", "rloo", "reinforce_pp-baseline"])
def test_groups_without_spread_get_zero_advantages(name: str) -> None:
    # two groups of identical scores (all winners, all losers), ragged and one-token responses
    rewards = t([0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    advantages, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=3)
    assert torch.equal(advantages, torch.zeros_like(advantages))  # zeros, not NaN


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp-baseline"])
def test_a_batch_without_spread_gets_zero_advantages(name: str) -> None:
    rewards = t([0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.bool)
    advantages, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=2)
    assert torch.equal(advantages, torch.zeros_like(advantages))


def test_rloo_identical_winners_are_zero_not_nan() -> None:
    # each response's baseline is the mean of the 3 others: (1 + 1 + 1) / 3 = 1 -> 1 - 1 = 0
    assert torch.equal(rloo_advantages(t(1.0, 1.0, 1.0, 1.0), 4), torch.zeros(4, dtype=F64))
    # and with one row failed: imputed to the group's mean, it changes no one's baseline
    rewards = t([1.0], [0.0], [1.0], [1.0])
    mask = torch.tensor([[1], [0], [1], [1]], dtype=torch.bool)
    valid = torch.tensor([True, False, True, True])
    advantages, _ = ADVANTAGE_ESTIMATORS["rloo"](rewards, mask, group_size=4, row_valid=valid)
    assert torch.equal(advantages, torch.zeros(4, 1, dtype=F64))


@pytest.mark.parametrize("name", sorted(set(ADVANTAGE_ESTIMATORS) - {"gae"}))
def test_all_tokens_masked_gives_zero_advantages(name: str) -> None:
    rewards = t([1.0, 2.0], [0.0, 3.0])
    mask = torch.zeros(2, 2, dtype=torch.bool)
    advantages, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=2)
    assert torch.equal(advantages, torch.zeros(2, 2, dtype=F64))


def test_the_recipe_names_the_estimators_row() -> None:
    from rlx.trainer.loop import estimator_name

    assert estimator_name("reinforce_pp", True, "batch") == "reinforce_pp"
    assert estimator_name("reinforce_pp", True, "group") == "reinforce_pp-baseline"
    assert estimator_name("grpo", False, "group") == "grpo-no-std"
    for algorithm in ("grpo", "ppo", "rloo", "reinforce_pp"):
        for baseline in ("batch", "group"):
            assert estimator_name(algorithm, True, baseline) in ADVANTAGE_ESTIMATORS
