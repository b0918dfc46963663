"""Statistics over the valid entries of a mask (B, T) of 0/1 floats or bools."""

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x over valid entries; padding is dropped even when it holds inf or NaN."""
    kept = torch.where(mask.bool(), x, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over valid entries; 0 (not NaN) where nothing is valid."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all valid entries (Bessel-corrected when unbiased and count > 1)."""
    count = mask.to(x.dtype).sum()
    centered = x - masked_mean(x, mask)
    correction = 1 if unbiased else 0
    return masked_sum(centered.square(), mask) / (count - correction).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Scale x to unit variance over valid entries (and zero mean if shift_mean); padding -> 0."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over valid tokens: 1 is a perfect critic, <= 0 is no better than
    a constant. NaN when the returns do not vary, since the ratio is then undefined."""
    values, returns = values.detach(), returns.detach()
    var_returns = masked_var(returns, mask)
    ratio = masked_var(returns - values, mask) / var_returns
    return torch.where(var_returns > 0, 1 - ratio, float("nan"))  # no host sync on GPU
