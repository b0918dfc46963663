"""What a weight push carries of a model: its parameters, or a LoRA model's adapters alone,
as whole tensors where they are sharded."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from rlx.trainer.model.lora import is_adapter


def pushed_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """What a weight push carries of the policy: every parameter (tied ones once), or, for a
    model with LoRA adapters, the adapters alone (the engines hold the frozen base)."""
    params = list(module.named_parameters())
    if any(is_adapter(name) for name, _ in params):
        params = [(name, param) for name, param in params if is_adapter(name)]
    yield from params


def engine_tensors(module: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """The pushed parameters (pushed_parameters) as whole tensors in `dtype` (their own when
    None), where they are, one at a time: what a colocated engine loads. A sharded one is
    cast before it is gathered (half the bytes of gathering float32 master weights), a
    collective of every rank."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, param in pushed_parameters(module):
            tensor = param.detach().to(dtype or param.dtype)
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, tensor
