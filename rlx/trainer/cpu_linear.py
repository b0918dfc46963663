"""Linear layers on the CPU through oneDNN where it outruns the BLAS torch calls by default.

torch runs a float32 nn.Linear on the CPU as a BLAS sgemm: MKL in the x86-64 wheels. MKL
picks its code path by the processor's vendor, and on AMD processors that have AVX-512 it
takes a narrower one; oneDNN, which ships inside the same torch, picks its kernels by the
instructions the processor has. Measured on a 2-core AMD EPYC with AVX-512 (2 threads): a
(2400 x 256) by (256 x 1024) product took 6.0 ms through MKL, 3.0 ms through oneDNN; the
backward's two products 6.5 and 6.6 ms against 2.6 and 5.1 ms. On a processor where MKL
runs its widest path the two are about even, so which one a process uses is measured once
(`choice`): oneDNN only where it is clearly faster on a learner-sized product, else
nothing changes. RLX_CPU_LINEAR=onednn|blas decides without measuring.

`use_onednn(model)` turns a model's plain nn.Linear layers into OneDNNLinear, a subclass
whose forward (and backward, in fp32) runs oneDNN's product on plain float32 CPU tensors and
nn.Linear's own forward on anything else (autocast, another dtype or device, a DTensor),
so a layer keeps working wherever the model goes. Its parameters, state dict and saved
checkpoints are an nn.Linear's. The products differ from BLAS's only in the order of the
sums: float32 rounding, a few 1e-7 relative.

oneDNN keeps what it builds for each product shape (rows, in, out) in two caches, torch's
(LRU_CACHE_CAPACITY) and its own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries each by
default. A learner's passes differ in rows from step to step, so over a run they filled
with shapes that never came back: bench/trainer.py's tiny model, its learner and HF engine
in one process, grew from 0.51 to 1.84 GiB over 100 steps (and was still growing). rlx's
package sets both to 64 (rlx/__init__.py: torch reads the first as it loads) unless they
are set: the same 100 steps then held 0.81-0.94 GiB, as with BLAS (0.82-0.86), at the same
speed.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENV = "RLX_CPU_LINEAR"  # onednn | blas | auto (the default: measured)
CHOICES = ("auto", "onednn", "blas")
# oneDNN is taken only when the measured product runs at least this much faster: a margin
# that rounding of the timings (a loaded machine) cannot cross, where the gap is real (2x).
MARGIN = 1.3
PROBE = (512, 256, 1024)  # rows, in, out: a learner pass's product, ~0.3 GFLOP
PROBE_REPEATS = 5


def _product() -> Callable[..., Tensor] | None:
    """oneDNN's linear (y = x W^T + b on dense float32 tensors, any strides), or None where
    this torch has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias through oneDNN, without autograd."""
    product = _product()
    assert product is not None
    flat = x.reshape(-1, x.shape[-1])
    return product(flat, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


def reorder_weight(weight: Tensor, rows: int) -> Tensor:
    """A copy of `weight` (out, in) in the layout oneDNN's product reads fastest for about
    `rows` rows at a time; onednn_linear takes it in the weight's place (any number of rows),
    F.linear does not. For weights that stay fixed while it is used (a generation's)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _best_time(fn: Callable[[], Tensor]) -> float:
    fn()
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Decision:
    taken: str  # "onednn" | "blas"
    speed: float | None  # oneDNN's speed over BLAS's, where it was measured


@functools.cache
def decision() -> Decision:
    """What this process's CPU linears run on (see the module's note), decided once: by
    ENV, else by the best of a few timings of each on PROBE. BLAS where oneDNN is missing,
    gives a different product, or is not MARGIN faster."""
    asked = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if asked not in CHOICES:
        raise ValueError(f"{ENV}={asked!r}: use one of {', '.join(CHOICES)}")
    if asked == "blas" or _product() is None:
        return Decision("blas", None)
    rows, width, out = PROBE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    weight = torch.randn(out, width, generator=generator)
    with torch.no_grad():
        try:
            got = onednn_linear(x, weight)
        except RuntimeError:
            return Decision("blas", None)
        want = F.linear(x, weight)
        if float((got - want).abs().max()) > 1e-4 * float(want.abs().max()):
            return Decision("blas", None)
        if asked == "onednn":
            return Decision("onednn", None)
        speed = _best_time(lambda: F.linear(x, weight)) / _best_time(
            lambda: onednn_linear(x, weight)
        )
    return Decision("onednn" if speed >= MARGIN else "blas", speed)


def choice() -> str:
    """ "onednn" or "blas": decision().taken."""
    return decision().taken


def describe() -> str:
    """The one line a run's log gets: what its CPU linears run on, and why."""
    taken, speed = decision().taken, decision().speed
    measured = f"{speed:.1f}x BLAS's speed measured here" if speed else f"{ENV} set"
    if taken == "onednn":
        return f"cpu linears: oneDNN ({measured}; {ENV}=blas keeps BLAS)"
    if speed:
        return f"cpu linears: BLAS (oneDNN at {measured}, under the {MARGIN}x it must beat)"
    return "cpu linears: BLAS" + ("" if _product() is None else f" ({ENV} set)")


def plain(tensor: Tensor | None) -> bool:
    """A dense float32 CPU tensor (or Parameter), not a subclass such as DTensor."""
    return tensor is None or (
        type(tensor) in (Tensor, nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and tensor.layout == torch.strided
    )


def runs_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a linear of these tensors goes through oneDNN: plain float32 CPU tensors,
    autocast off, at least one row."""
    return (
        plain(x)
        and plain(weight)
        and plain(bias)
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    )


class _OneDNNProduct(torch.autograd.Function):
    """y = x W^T + b and its gradients, every product through oneDNN: dx = dy W,
    dW = dy^T x (as oneDNN linears over transposed views, which it reads in place)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        product = _product()
        assert product is not None
        flat = grad.reshape(-1, grad.shape[-1])  # (M, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = product(flat, weight.t(), None, "none", [], "").view(x.shape)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1])  # (M, in)
            grad_weight = product(flat.t(), rows.t(), None, "none", [], "")  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def _through_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if runs_onednn(x, weight, bias):
        return _OneDNNProduct.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, run as this process's CPU linears are (`choice`): for products outside
    an nn.Linear's forward (the log-probs' head product over a chunk of tokens)."""
    if choice() == "onednn":
        return _through_onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose float32 CPU products run through oneDNN (see the module's note)."""

    def forward(self, input: Tensor) -> Tensor:
        return _through_onednn(input, self.weight, self.bias)


def use_onednn(model: nn.Module) -> int:
    """Turn the model's plain nn.Linear layers (peft's adapters' and base layers included)
    into OneDNNLinear where this process's choice is oneDNN: how many it turned. Layers keep
    their parameters; nothing else about the model changes."""
    if choice() != "onednn":
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            turned += 1
    return turned


def is_linear(module: nn.Module) -> bool:
    """An nn.Linear as torch writes it, or the same layer running through oneDNN."""
    return type(module) in (nn.Linear, OneDNNLinear)
