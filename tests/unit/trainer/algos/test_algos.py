"""Hand-worked checks of the trainer's RL math; expected numbers are derived in the comments."""

import math
from collections.abc import Callable, Mapping

import pytest
import torch
from torch import nn

from rlx.trainer.algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    aggregate_loss,
    broadcast_to_tokens,
    clipped_value_loss,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    get_advantage_estimator,
    get_aggregation,
    get_kl_estimator,
    grpo_advantages,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    logprobs_from_logits,
    loss_denominators,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    rloo_advantages,
)


def t(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- masked statistics


def test_masked_stats_ignore_padding_even_when_it_is_nan() -> None:
    x = t([1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # valid entries 1, 2, 3: sum 6, mean 2, unbiased var ((1 + 0 + 1) / 2) = 1
    assert masked_sum(x, mask).item() == 6.0
    assert masked_mean(x, mask).item() == 2.0
    assert masked_var(x, mask).item() == 1.0
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    # per row: [1 + 2, 3] / [2, 1]
    assert torch.equal(masked_mean(x, mask, dim=-1), t(1.5, 3.0))
    # mean 2, std 1 -> (-1, 0, 1), padding zeroed
    expected = t([-1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
    assert torch.allclose(masked_whiten(x, mask), expected, atol=1e-6)
    # an empty mask gives 0, not NaN
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_explained_variance() -> None:
    returns = t([1.0, 2.0, 3.0, 99.0])
    mask = t([1.0, 1.0, 1.0, 0.0])
    # perfect critic -> 1; constant critic at the mean (2) -> 1 - Var[R] / Var[R] = 0
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(t([2.0, 2.0, 2.0, 0.0]), returns, mask).item() == pytest.approx(0.0)
    # residuals (0, 0, 1): Var = (1/9 + 1/9 + 4/9) / 2 = 1/3; Var[R] = 1 -> 1 - 1/3
    values = t([1.0, 2.0, 2.0, 0.0])
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3)
    assert math.isnan(explained_variance(values, t([5.0, 5.0, 5.0, 1.0]), mask).item())


# ---------------------------------------------------------------- GAE


def test_gae_one_sequence() -> None:
    # gamma = lambda = 0.5 -> gamma * lambda = 0.25; V after the end is 0.
    # t=2: delta = 1 + 0.5 * 0    - 0.5  =  0.5;   A2 = 0.5
    # t=1: delta = 0 + 0.5 * 0.5  - 0.25 =  0;     A1 = 0 + 0.25 * 0.5 = 0.125
    # t=0: delta = 0 + 0.5 * 0.25 - 0.5  = -0.375; A0 = -0.375 + 0.25 * 0.125 = -0.34375
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 0.25, 0.5]), t([1.0, 1.0, 1.0])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.5, gae_lambda=0.5)
    assert torch.allclose(advantages, t([-0.34375, 0.125, 0.5]))
    assert torch.allclose(returns, t([0.15625, 0.375, 1.0]))
    assert torch.allclose(returns, advantages + values)


def test_gae_right_padding_does_not_leak() -> None:
    # gamma = 0.5, lambda = 0.8 -> gamma * lambda = 0.4.
    # row 0 (3 tokens): A2 = 1 - 0.5 = 0.5; delta1 = 0.5 * 0.5 - 0.25 = 0, A1 = 0.4 * 0.5 = 0.2
    #                   delta0 = 0.5 * 0.25 - 0.5 = -0.375, A0 = -0.375 + 0.4 * 0.2 = -0.295
    # row 1 (2 tokens, padding holds reward 7 and value 9 that must not count):
    #                   A1 = 1 + 0.5 * 0 - 0.5 = 0.5
    #                   delta0 = 0.5 * 0.5 - 1 = -0.75, A0 = -0.75 + 0.4 * 0.5 = -0.55
    rewards = t([0.0, 0.0, 1.0], [0.0, 1.0, 7.0])
    values = t([0.5, 0.25, 0.5], [1.0, 0.5, 9.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.5, gae_lambda=0.8)
    assert torch.allclose(advantages, t([-0.295, 0.2, 0.5], [-0.55, 0.5, 0.0]))
    assert torch.allclose(returns, t([0.205, 0.45, 1.0], [0.45, 1.0, 0.0]))
    valid = mask.bool()
    assert torch.allclose(returns[valid], (advantages + values)[valid])
    assert not advantages.requires_grad


def test_gae_steps_over_masked_tokens_inside_a_response() -> None:
    # Token 1 is not an action (e.g. tool output): t=0 bootstraps from t=2.
    # t=2: A = 1 - 0.5 = 0.5; t=0: delta = 0.5 * 0.5 - 0.5 = -0.25, A = -0.25 + 0.25 * 0.5
    rewards, values, mask = t([0.0, 5.0, 1.0]), t([0.5, 99.0, 0.5]), t([1.0, 0.0, 1.0])
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.5, gae_lambda=0.5)
    assert torch.allclose(advantages, t([-0.125, 0.0, 0.5]))


# ---------------------------------------------------------------- outcome advantages


def test_grpo_two_groups() -> None:
    # group 0 = (1, 0, 0): mean 1/3, deviations (2/3, -1/3, -1/3),
    #   unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 1/sqrt(3)
    #   -> (2/3 * sqrt(3), -1/3 * sqrt(3), ...) = (1.1547, -0.57735, -0.57735)
    # group 1 = (0.5, 0.5, 0.5): all equal -> zeros, not NaN
    scores = t(1.0, 0.0, 0.0, 0.5, 0.5, 0.5)
    r3 = math.sqrt(3)
    advantages = grpo_advantages(scores, group_size=3)
    assert torch.allclose(advantages, t(2 * r3 / 3, -r3 / 3, -r3 / 3, 0, 0, 0), atol=1e-5)
    assert torch.isfinite(advantages).all()
    plain = grpo_advantages(scores, group_size=3, norm_by_std=False)
    assert torch.allclose(plain, t(2 / 3, -1 / 3, -1 / 3, 0, 0, 0))


def test_rloo_by_hand() -> None:
    # group 0 = (1, 0, 0): baselines (0+0)/2, (1+0)/2, (1+0)/2 -> (1, -0.5, -0.5)
    # group 1 = (3, 1, 2): baselines 1.5, 2.5, 2 -> (1.5, -1.5, 0)
    advantages = rloo_advantages(t(1.0, 0.0, 0.0, 3.0, 1.0, 2.0), group_size=3)
    assert torch.allclose(advantages, t(1.0, -0.5, -0.5, 1.5, -1.5, 0.0))


@pytest.mark.parametrize("estimate", [grpo_advantages, rloo_advantages])
def test_group_size_errors(estimate: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        estimate(t(1.0, 2.0), 1)
    with pytest.raises(ValueError, match="divisible by group_size=2"):
        estimate(t(1.0, 2.0, 3.0), 2)


def test_outcome_estimator_from_token_rewards() -> None:
    # The score sits on the last valid token; padding holds junk that must not count.
    # scores: row sums over valid tokens = (1, 0, 0.5, 0.5); RLOO with G=2 -> (1, -1, 0, 0)
    token_rewards = t([0.0, 1.0, 5.0], [0.0, 0.0, 5.0], [0.5, 5.0, 5.0], [0.0, 0.5, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    advantages, returns = get_advantage_estimator("rloo")(token_rewards, mask, group_size=2)
    expected = t([1.0, 1.0, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert torch.allclose(advantages, expected)
    assert torch.allclose(returns, expected)
    assert torch.equal(broadcast_to_tokens(t(2.0, 3.0), mask[:2]), t([2.0, 2.0, 0], [3, 3, 0]))


def test_gae_estimator_from_table_needs_values() -> None:
    gae = ADVANTAGE_ESTIMATORS["gae"]
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 0.25, 0.5]), t([1.0, 1.0, 1.0])
    advantages, _ = gae(rewards, mask, values=values, gamma=0.5, gae_lambda=0.5)
    assert torch.allclose(advantages, t([-0.34375, 0.125, 0.5]))
    with pytest.raises(ValueError, match="needs critic values"):
        gae(rewards, mask)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand() -> None:
    logp, ref_logp = t(-1.0, -2.0, -3.0), t(-2.0, -1.0, -3.0)
    # log r = ref - logp = (-1, 1, 0)
    assert torch.allclose(kl_k1(logp, ref_logp), t(1.0, -1.0, 0.0))
    assert torch.allclose(kl_k2(logp, ref_logp), t(0.5, 0.5, 0.0))
    # k3 = e^{log r} - 1 - log r: e^-1 - 1 + 1 = 0.367879; e - 1 - 1 = 0.718282; 0
    assert torch.allclose(kl_k3(logp, ref_logp), t(math.exp(-1), math.e - 2, 0.0))


def test_k3_is_non_negative_and_its_gradient_is_sane() -> None:
    gen = torch.Generator().manual_seed(0)
    logp, ref_logp = 5 * torch.randn(1000, generator=gen), 5 * torch.randn(1000, generator=gen)
    assert (kl_k3(logp, ref_logp) >= 0).all()
    # d k3 / d logp = 1 - e^{ref - logp}: (1 - e^-1, 1 - e, 0); descending moves logp toward ref
    logp = t(-1.0, -2.0, -3.0).requires_grad_()
    kl_k3(logp, t(-2.0, -1.0, -3.0)).sum().backward()
    assert torch.allclose(logp.grad, t(1 - math.exp(-1), 1 - math.e, 0.0))
    # overflow guard: a 1000-nat disagreement stays finite
    assert torch.isfinite(kl_k3(torch.tensor([-1000.0]), torch.tensor([0.0]))).all()


def test_kl_penalized_rewards_are_detached_and_masked() -> None:
    logp = t([-1.0, -2.0]).requires_grad_()
    rewards, kl = kl_penalized_rewards(
        t([0.0, 1.0]), logp, t([-2.0, -1.0]), t([1.0, 0.0]), kl_coef=0.1, estimator="k1"
    )
    # k1 = (1, -1) -> padding zeroed -> (1, 0); rewards (0 - 0.1 * 1, 1 - 0)
    assert torch.allclose(kl, t([1.0, 0.0]))
    assert torch.allclose(rewards, t([-0.1, 1.0]))
    assert not rewards.requires_grad


# ---------------------------------------------------------------- policy loss


def _policy_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # tokens: a inside the clip range, b clipped above, c clipped below, d outside the range
    # but unclipped (the pessimistic max keeps the larger loss), e padding with an absurd ratio
    ratios = [1.1, 1.5, 0.5, 1.5, 100.0]
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64).requires_grad_()
    old_logp = torch.zeros_like(logp)
    advantages = t([1.0, 2.0, -1.0, -1.0, 1.0])
    mask = t([1.0, 1.0, 1.0, 1.0, 0.0])
    return logp, old_logp, advantages, mask


def test_policy_loss_clip_cases() -> None:
    logp, old_logp, advantages, mask = _policy_case()
    loss, metrics = ppo_policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2)
    # a: max(-1 * 1.1, -1 * 1.1) = -1.1
    # b: max(-2 * 1.5, -2 * 1.2) = -2.4 (clipped)
    # c: max(1 * 0.5, 1 * 0.8) = 0.8 (clipped)
    # d: max(1 * 1.5, 1 * 1.2) = 1.5
    assert torch.allclose(loss, t([-1.1, -2.4, 0.8, 1.5, 0.0]))
    # d loss / d logp = -A * ratio where unclipped, 0 where clipped
    loss.sum().backward()
    assert torch.allclose(logp.grad, t([-1.1, 0.0, 0.0, 1.5, 0.0]))
    # b and c clipped -> 2 / 4
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    # (r - 1) - log r: a 0.1 - 0.0953102 = 0.0046898; b, d 0.5 - 0.4054651 = 0.0945349;
    # c -0.5 + 0.6931472 = 0.1931472 -> mean 0.3869068 / 4
    assert metrics["approx_kl"].item() == pytest.approx(0.0967267, abs=1e-6)
    # (1.1 + 1.5 + 0.5 + 1.5) / 4
    assert metrics["ratio_mean"].item() == pytest.approx(1.15)
    assert "dual_clipfrac" not in metrics


def test_policy_loss_asymmetric_clip() -> None:
    logp, old_logp, advantages, mask = _policy_case()
    loss, _ = ppo_policy_loss(
        logp, old_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28
    )
    # b: max(-3, -2 * 1.28) = -2.56; c still clipped at 1 - 0.2 = 0.8
    assert torch.allclose(loss, t([-1.1, -2.56, 0.8, 1.5, 0.0]))


def test_policy_loss_dual_clip() -> None:
    logp = torch.log(t([5.0, 1.5, 5.0])).requires_grad_()
    advantages, mask = t([-1.0, -1.0, 1.0]), t([1.0, 1.0, 1.0])
    loss, metrics = ppo_policy_loss(
        logp, torch.zeros_like(logp), advantages, mask, clip_eps_low=0.2, dual_clip_c=3.0
    )
    # ratio 5, A -1: max(5, 1.2) = 5, capped at -3 * A = 3
    # ratio 1.5, A -1: max(1.5, 1.2) = 1.5 < 3, untouched
    # ratio 5, A +1: max(-5, -1.2) = -1.2, the cap only concerns negative advantages
    assert torch.allclose(loss, t([3.0, 1.5, -1.2]))
    assert metrics["dual_clipfrac"].item() == pytest.approx(1 / 3)
    loss.sum().backward()
    assert torch.allclose(logp.grad, t([0.0, 1.5, 0.0]))
    with pytest.raises(ValueError, match="greater than 1"):
        ppo_policy_loss(logp, logp, advantages, mask, dual_clip_c=1.0)


def test_policy_loss_survives_huge_log_ratio() -> None:
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old_logp = torch.tensor([[-1e4, -50.0]])
    loss, metrics = ppo_policy_loss(logp, old_logp, torch.tensor([[-1.0, 0.0]]), torch.ones(1, 2))
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(value) for value in metrics.values())


# ---------------------------------------------------------------- value loss


def test_value_loss_clipped_and_not() -> None:
    values = t([1.1, 1.5, 1.5, 7.0]).requires_grad_()
    old_values, returns, mask = t([1.0, 1.0, 1.0, 0.0]), t([2.0, 2.0, 0.0, 0.0]), t([1, 1, 1, 0])
    loss, metrics = clipped_value_loss(values, old_values, returns, mask, clip_eps=0.2)
    # 1: v_clip = 1.1 (inside), 0.5 * 0.9^2 = 0.405
    # 2: v_clip = 1.2; max(0.5^2, 0.8^2) = 0.64 -> 0.32, clipped (no gradient)
    # 3: v_clip = 1.2; max(1.5^2, 1.2^2) = 2.25 -> 1.125, unclipped
    assert torch.allclose(loss, t([0.405, 0.32, 1.125, 0.0]))
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.sum().backward()
    # d/dv 0.5 (v - R)^2 = v - R where unclipped
    assert torch.allclose(values.grad, t([-0.9, 0.0, 1.5, 0.0]))
    unclipped, _ = clipped_value_loss(values, old_values, returns, mask, clip_eps=None)
    assert torch.allclose(unclipped, t([0.405, 0.125, 1.125, 0.0]))


# ---------------------------------------------------------------- logits


def test_entropy_from_logits() -> None:
    assert torch.allclose(
        entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7))
    )
    # p = (1/4, 3/4): H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, math.log(3)], [100.0, 100.0 + math.log(3)]]])
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([[0.562335, 0.562335]]))
    half = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    assert entropy_from_logits(half).dtype == torch.float32


def test_logprobs_from_logits() -> None:
    # p = (1/4, 3/4): log p(1) = ln 0.75 = -0.287682
    logits = torch.tensor([[[0.0, math.log(3)]]])
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(-0.287682)
    gen = torch.Generator().manual_seed(0)
    logits = 10 * torch.randn(3, 4, 11, generator=gen)
    tokens = torch.randint(0, 11, (3, 4), generator=gen)
    manual = logits - logits.exp().sum(-1, keepdim=True).log()  # (B, T, V)
    expected = manual.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    assert torch.allclose(logprobs_from_logits(logits, tokens), expected, atol=1e-5)
    bf16 = logprobs_from_logits(logits.bfloat16(), tokens)
    assert bf16.dtype == torch.float32


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand() -> None:
    loss = t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    num_tokens, num_seqs = loss_denominators(mask)
    assert (num_tokens.item(), num_seqs.item()) == (4, 2)  # the empty row is not a sequence
    # token-mean: (1 + 2 + 3 + 4) / 4
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: (6/3 + 4/1) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: (6 + 4) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # global denominators replace the local ones: 10 / 8 and (2 + 4) / 5
    assert aggregate_loss(loss, mask, num_global_tokens=8).item() == pytest.approx(1.25)
    seq_mean = aggregate_loss(loss, mask, "seq-mean-token-mean", num_global_seqs=5)
    assert seq_mean.item() == pytest.approx(1.2)


class TinyPolicy(nn.Module):
    """Embedding features -> linear head over a small vocabulary."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.head = nn.Linear(dim, vocab)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)  # (B, T, V)


def _policy_gradient(
    model: TinyPolicy,
    batch: dict[str, torch.Tensor],
    rows: slice,
    mode: str,
    num_tokens: torch.Tensor | None,
    num_seqs: torch.Tensor | None,
) -> list[torch.Tensor]:
    logp = logprobs_from_logits(model(batch["features"][rows]), batch["tokens"][rows])  # (b, T)
    loss, _ = ppo_policy_loss(
        logp, batch["old_logp"][rows], batch["advantages"][rows], batch["mask"][rows]
    )
    scalar = aggregate_loss(
        loss,
        batch["mask"][rows],
        mode,
        num_global_tokens=num_tokens,
        num_global_seqs=num_seqs,
        token_budget=batch["mask"].shape[-1],  # a constant, the same for every micro-batch
    )
    return list(torch.autograd.grad(scalar, list(model.parameters())))


def _accumulated_gradient(
    model: TinyPolicy, batch: dict[str, torch.Tensor], sizes: list[int], mode: str, glob: bool
) -> list[torch.Tensor]:
    num_tokens, num_seqs = loss_denominators(batch["mask"]) if glob else (None, None)
    total = [torch.zeros_like(p) for p in model.parameters()]
    start = 0
    for size in sizes:
        grads = _policy_gradient(
            model, batch, slice(start, start + size), mode, num_tokens, num_seqs
        )
        total = [acc + grad for acc, grad in zip(total, grads, strict=True)]
        start += size
    assert start == batch["mask"].shape[0]
    return total


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batch_gradients_equal_one_pass(mode: str) -> None:
    torch.manual_seed(0)
    batch_size, num_tokens, dim, vocab = 8, 6, 4, 5
    model = TinyPolicy(dim, vocab)
    lengths = torch.tensor([6, 1, 3, 0, 2, 5, 4, 6])  # ragged, one empty response
    mask = torch.arange(num_tokens) < lengths.unsqueeze(-1)  # (B, T)
    features = torch.randn(batch_size, num_tokens, dim)  # (B, T, D)
    tokens = torch.randint(0, vocab, (batch_size, num_tokens))  # (B, T)
    with torch.no_grad():
        logp = logprobs_from_logits(model(features), tokens)  # (B, T)
    batch = {
        "features": features,
        "tokens": tokens,
        # behaviour policy a little off the current one, so some ratios clip
        "old_logp": logp + 0.3 * torch.randn(batch_size, num_tokens),
        "advantages": torch.randn(batch_size, num_tokens),
        "mask": mask,
    }
    one_pass = _accumulated_gradient(model, batch, [8], mode, glob=True)
    assert any(grad.abs().max() > 1e-3 for grad in one_pass)
    for sizes in ([2, 2, 2, 2], [1, 3, 4], [5, 2, 1]):
        micro = _accumulated_gradient(model, batch, sizes, mode, glob=True)
        for full, split in zip(one_pass, micro, strict=True):
            assert torch.allclose(full, split, atol=1e-6), (mode, sizes)
    # The global denominator is what makes this hold: local counts weight tokens unequally.
    local = _accumulated_gradient(model, batch, [1, 3, 4], mode, glob=False)
    assert not all(
        torch.allclose(full, split, atol=1e-4) for full, split in zip(one_pass, local, strict=True)
    )


# ---------------------------------------------------------------- name tables


@pytest.mark.parametrize(
    ("get", "bad_name", "table"),
    [
        (get_advantage_estimator, "ppo", ADVANTAGE_ESTIMATORS),
        (get_kl_estimator, "k4", KL_ESTIMATORS),
        (get_aggregation, "mean", AGGREGATIONS),
    ],
)
def test_unknown_names_list_the_valid_ones(
    get: Callable[[str], object], bad_name: str, table: Mapping[str, object]
) -> None:
    with pytest.raises(ValueError, match=f"unknown .*'{bad_name}'") as excinfo:
        get(bad_name)
    for name in table:
        assert repr(name) in str(excinfo.value)
    with pytest.raises(ValueError, match="'token-mean'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum")


def test_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        KL_ESTIMATORS["k9"] = kl_k1  # type: ignore[index]
