"""Linear layers on the CPU through oneDNN where the CPU has AVX-512, BLAS elsewhere.

torch runs a float32 nn.Linear on the CPU as a BLAS sgemm: MKL in the x86-64 wheels. MKL
picks its code path by the processor's vendor, and on AMD processors that have AVX-512 it
takes a narrower one; oneDNN, which ships inside the same torch, picks its kernels by the
instructions the processor has. Measured on a 2-core AMD EPYC with AVX-512 (2 threads): a
(2400 x 256) by (256 x 1024) product took 6.0 ms through MKL, 3.0 ms through oneDNN; the
backward's two products 6.5 and 6.6 ms against 2.6 and 5.1 ms. On a 2-core AMD EPYC with
AVX2 alone oneDNN ran a learner-sized product (512 x 256 by 256 x 1024) at 0.8-1.1x BLAS's
speed, quiet, at 1 and 2 threads; on a processor where MKL runs its widest path the two
are about even.

Which one a process uses changes the last bits of every result (the two sum in another
order), so it is decided from what the CPU can do, never by timing (`decision`): oneDNN
where the CPU has AVX-512 and oneDNN may use it, else BLAS. A start-up timing did decide
once, and on a loaded machine it flipped (on the AVX2 EPYC, 3 to 8 of 30 timings under
two busy processes measured oneDNN 1.3-2.1x faster), so two runs of one seed, or a run and
its resume, could take different kernels. The decision is a pure function of the CPU and
the environment: the same on the same machine whatever its load, so a run resumed there
takes what it took before (the run's log says which, and why). oneDNN's own ISA cap,
ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA), is honoured: below AVX-512 (AVX2,
as a stand-in for an AVX2-only machine) it means BLAS. RLX_CPU_LINEAR=onednn|blas decides
instead. `measured_speed()` still times the two, for benchmarks: a figure, not a vote.

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
in one process, grew from 0.51 to 1.84 GiB over 100 steps (and was still growing). A
trainer's Ray workers set both to 64 (rlx/trainer/actors/__init__.py, before torch loads:
it reads the first as it does) unless they are set: the same 100 steps then held 0.81-0.94
GiB, as with BLAS (0.82-0.86), at the same speed.
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

ENV = "RLX_CPU_LINEAR"  # onednn | blas | auto (the default: from the CPU's features)
CHOICES = ("auto", "onednn", "blas")
# oneDNN's cap on the instructions it uses; a value naming AVX-512 or above (or no cap)
# leaves it its AVX-512 kernels.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
UNCAPPED = ("ALL", "DEFAULT")
WIDE_ISAS = ("AVX512", "AVX10")  # AVX512_CORE, AVX512_CORE_AMX, AVX10_1_512, ...
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


def _probe_operands() -> tuple[Tensor, Tensor]:
    rows, width, out = PROBE
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, width, generator=generator), torch.randn(
        out, width, generator=generator
    )


def onednn_isa_cap() -> str | None:
    """The cap oneDNN was given on the instructions it may use, upper-cased, or None."""
    for name in ISA_CAPS:
        value = os.environ.get(name, "").strip().upper()
        if value:
            return value
    return None


def avx512_for_onednn() -> tuple[bool, str]:
    """Whether oneDNN may run AVX-512 kernels here, and why (for the run's log): the CPU has
    AVX-512 as torch reads it (ATen's capability, from the CPU's feature flags; ATEN_CPU_CAPABILITY
    lowers it) and ONEDNN_MAX_CPU_ISA does not cap oneDNN below it."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if not capability.startswith(WIDE_ISAS):
        return False, f"this CPU runs {capability}, no AVX-512"
    cap = onednn_isa_cap()
    if cap is not None and cap not in UNCAPPED and not cap.startswith(WIDE_ISAS):
        return False, f"this CPU has AVX-512 but ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below it"
    return True, "this CPU has AVX-512"


@dataclass(frozen=True)
class Decision:
    taken: str  # "onednn" | "blas"
    reason: str  # why, as the run's log says it


@functools.cache
def decision() -> Decision:
    """What this process's CPU linears run on (see the module's note), decided once and
    without timing: by ENV, else oneDNN where `avx512_for_onednn`. BLAS where oneDNN is
    missing or gives a different product. A pure function of the CPU and the environment,
    so a resumed run on the same machine takes what the run took."""
    asked = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if asked not in CHOICES:
        raise ValueError(f"{ENV}={asked!r}: use one of {', '.join(CHOICES)}")
    if asked == "blas":
        return Decision("blas", f"{ENV} set")
    if _product() is None:
        return Decision("blas", "this torch has no oneDNN linear")
    if asked == "auto":
        wide, why = avx512_for_onednn()
        if not wide:
            return Decision("blas", f"{why}; {ENV}=onednn takes oneDNN")
    else:
        why = f"{ENV} set"
    x, weight = _probe_operands()
    with torch.no_grad():
        try:
            got = onednn_linear(x, weight)
        except RuntimeError:
            return Decision("blas", "oneDNN's product failed here")
        want = F.linear(x, weight)
    if float((got - want).abs().max()) > 1e-4 * float(want.abs().max()):
        return Decision("blas", "oneDNN's product differs from BLAS's here")
    if asked == "auto":
        why = f"{why}; {ENV}=blas keeps BLAS"
    return Decision("onednn", why)


def choice() -> str:
    """ "onednn" or "blas": decision().taken."""
    return decision().taken


def describe() -> str:
    """The one line a run's log gets: what its CPU linears run on, and why."""
    taken = decision()
    return f"cpu linears: {'oneDNN' if taken.taken == 'onednn' else 'BLAS'} ({taken.reason})"


def measured_speed() -> float | None:
    """oneDNN's speed over BLAS's on PROBE here and now (best of a few timings each), None
    where this torch has no oneDNN linear. A figure for benchmarks: it moves with the load
    (0.3-2.1x on one AVX2 machine), which is why `decision` never asks it."""
    if _product() is None:
        return None
    x, weight = _probe_operands()
    with torch.no_grad():
        return _best_time(lambda: F.linear(x, weight)) / _best_time(
            lambda: onednn_linear(x, weight)
        )


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
