"""Reading the gradient an update applies, for tests that compare updates.

An optimiser that records the gradients it is given instead of stepping: comparing gradients
(not weights before and after, whose float32 difference rounds at ~1e-7 of the weights)
keeps the tolerance far above float32 resolution on any CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class GradientRecorder(torch.optim.Optimizer):
    """Records each parameter's whole gradient (gathered when sharded) at every step, summed
    over steps, and leaves the parameters alone. Under FSDP every rank must step (the
    gather is a collective)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self.names = {id(p): name for name, p in named}
        super().__init__([p for _, p in named], {"lr": 0.0})
        self.gradients: dict[str, torch.Tensor] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                name = self.names[id(param)]
                grad = grad.detach().to("cpu", torch.float64)
                self.gradients[name] = self.gradients.get(name, 0) + grad
        self.steps += 1


def record_gradients(module: nn.Module) -> GradientRecorder:
    return GradientRecorder([(n, p) for n, p in module.named_parameters() if p.requires_grad])


def assert_same_gradients(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], relative: float = 1e-5
) -> float:
    """Every gradient within `relative` x the largest gradient entry; returns the largest
    difference seen, relative to that scale."""
    assert set(got) == set(want), set(got) ^ set(want)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    worst = max(float((got[name] - value).abs().max()) for name, value in want.items()) / scale
    assert worst <= relative, f"gradients differ by {worst:.3g} of the largest ({relative})"
    return worst


def gradient_of_update(learner: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The summed gradient one Learner update applies (no clipping in the settings), read from
    the gradients themselves: an optimiser that records them instead of stepping."""
    recorder = record_gradients(learner.policy)
    learner.optimizer = recorder
    learner.update(batch, step=1)
    return recorder.gradients


def assert_same_gradient(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert_same_gradients(got, want, relative=1e-5)
