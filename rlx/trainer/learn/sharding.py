"""How the training ranks share the models: one plain module (one rank), DDP (every rank a full
replica) or FSDP2 (parameters, gradients and optimiser state sharded over the ranks).

FSDP2 here: `fully_shard` on each decoder layer, then on the root, in place, so the modules keep
their Hugging Face parameter names (checkpoints use torch.distributed.checkpoint's
get_state_dict / set_state_dict on them). Models are built on the meta device, sharded, then
given memory, and each rank reads only its own rows of the safetensors: no rank ever holds a
whole copy.

Gradients: every rank's loss is already divided by the global token (or sequence) count, so
the right gradient is the SUM of the ranks' gradients. FSDP2 would average them (and gloo has
been reported to sum where it should average), so each FSDP unit is told to divide by 1 and to
reduce with a plain sum; test_parallel.py checks the result against one unsharded process.

Every forward of an FSDP module is a collective: all ranks must run the same number of them in
the same order. The helpers `all_ranks` and `most_over_ranks` let ranks agree before a
data-dependent choice (how many micro-batches, whether prompts are shared).
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlx.trainer.model.dtensors import local_rows
from rlx.trainer.model.lora import base_name
from rlx.trainer.model.push import pushed_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from rlx.recipe.model import ParallelSettings
    from rlx.trainer.weights import BucketLayout, Traffic

Strategy = Literal["single", "ddp", "fsdp"]

# The name under which a sharded module runs arbitrary code as one FSDP forward (see
# run_as_forward): the LM head and the chunked log-probs then run inside the root's forward.
FORWARD_METHOD = "run_as_forward"


def resolve_strategy(parallel: ParallelSettings, world_size: int) -> Strategy:
    """The strategy a run uses: one rank is always a plain module; 'auto' is FSDP otherwise."""
    from rlx.recipe.model import effective_strategy

    return effective_strategy(parallel.strategy, world_size)


@dataclass(frozen=True)
class ShardSpec:
    """How to shard one model with FSDP2.

    param_dtype: the dtype weights are all-gathered and computed in (bf16 on GPU), None to
    compute in the stored dtype. offload: shards (and for a trained model its gradients and
    optimiser state) live on the host, the optimiser steps on the CPU.
    """

    mesh: DeviceMesh
    device: torch.device
    param_dtype: torch.dtype | None = None
    offload: bool = False
    reshard_after_forward: bool = True


def make_mesh(device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over every rank of the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


# --------------------------------------------------------------------------- agreement


def all_ranks(flag: bool, device: torch.device | None = None) -> bool:
    """True when `flag` is true on every rank (itself when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(value)
    return int(value) == 0


def most_over_ranks(count: int, device: torch.device | None = None) -> int:
    """The largest `count` any rank has."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    value = torch.tensor([count], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


# --------------------------------------------------------------------------- sharding


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (the classes it names in
    `_no_split_modules`, e.g. Qwen2DecoderLayer), in order."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules); "
            "FSDP cannot shard it layer by layer: use trainer.parallel.strategy: ddp"
        )
    return layers


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard(model: nn.Module, spec: ShardSpec) -> None:
    """fully_shard each decoder layer, then the root, in place."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    precision = MixedPrecisionPolicy(
        param_dtype=spec.param_dtype,
        reduce_dtype=torch.float32 if spec.param_dtype is not None else None,
    )
    offload = CPUOffloadPolicy(pin_memory=spec.device.type == "cuda") if spec.offload else None
    options: dict[str, Any] = {
        "mesh": spec.mesh,
        "mp_policy": precision,
        "offload_policy": offload or OffloadPolicy(),
    }
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=spec.reshard_after_forward, **options)
    # The root keeps its weights gathered between forward and backward (FSDP2's default
    # for the root): the backward needs them at once.
    fully_shard(model, **options)
    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(
            f"torch {torch.__version__} cannot make FSDP2 sum gradients "
            "(FSDPModule.set_force_sum_reduction_for_comms); upgrade torch or use "
            "trainer.parallel.strategy: ddp"
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Losses are pre-divided by global counts: the ranks' gradients must be summed.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    run_method = types.MethodType(_run_as_forward, model)
    setattr(model, FORWARD_METHOD, run_method)
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, FORWARD_METHOD)
    if hasattr(model, "generate"):
        # One gather of the root for a whole generate call, not one per token.
        register_fsdp_forward_method(model, "generate")


def reshard(module: nn.Module) -> None:
    """Free a sharded root's gathered weights (FSDP2 keeps them after a forward of the root
    until the backward); no-op for other modules."""
    if is_sharded(module):
        module.reshard()  # type: ignore[operator]


def _run_as_forward(self: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def run_as_forward(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) as one forward of `module`: under FSDP2 its root weights are gathered for it
    and its backward is hooked up as for a forward; a plain call otherwise."""
    method = getattr(module, FORWARD_METHOD, None)
    return method(fn, *args) if method is not None else fn(*args)


# --------------------------------------------------------------------------- building


class _ParametersOnMeta:
    """Build modules with parameters on the meta device but buffers real: the buffers that
    are computed, not loaded (rotary inv_freq), then keep their values through to_empty."""

    def __enter__(self) -> _ParametersOnMeta:
        self._original = nn.Module.register_parameter
        original = self._original

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and param.device.type != "meta":  # tied: already moved
                kind = type(module._parameters[name])
                moved = module._parameters[name].to("meta")  # type: ignore[union-attr]
                module._parameters[name] = kind(moved, requires_grad=param.requires_grad)

        nn.Module.register_parameter = register  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        nn.Module.register_parameter = self._original  # type: ignore[method-assign]


def build_sharded(
    build: Callable[[], nn.Module],
    path: str,
    spec: ShardSpec,
    *,
    zero: Callable[[str], bool] = lambda name: False,
) -> nn.Module:
    """A model from `build()` (run with its parameters on the meta device), sharded by
    `spec`, given memory, and loaded from the safetensors in `path`, each rank reading only
    its own rows. Parameters for which zero(name) holds are set to zero instead of read."""
    with _ParametersOnMeta():
        model = build()
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    shard(model, spec)
    model.to_empty(device="cpu" if spec.offload else spec.device)
    # to_empty leaves every tensor uninitialised, buffers included: put them back.
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    load_shards(model, path, zero=zero)
    return model


def _checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from a model folder."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(folder / file) for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{folder} has no model.safetensors(.index.json): sharded loading reads "
            "safetensors only; convert the checkpoint (save_pretrained(..., "
            "safe_serialization=True)) and point the model's path at the new folder"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), str(single))


def _file_key(name: str, files: dict[str, str]) -> str | None:
    """The checkpoint name of parameter `name`: itself, without peft's wrapping (LoRA), or
    with the body prefix of a critic built on a causal LM's folder ("body.layers.0..." ->
    "model.layers.0..." or "layers...")."""
    candidates = [name, base_name(name)]
    if name.startswith("body."):
        rest = base_name(name.removeprefix("body."))
        candidates += [f"model.{rest}", rest]
    return next((key for key in candidates if key in files), None)


@torch.no_grad()
def load_shards(model: nn.Module, path: str, *, zero: Callable[[str], bool]) -> None:
    """Fill every parameter and persistent buffer of `model` from the safetensors in `path`,
    reading only the rows this rank holds (safetensors' get_slice reads just those bytes)."""
    from safetensors import safe_open

    files = _checkpoint_files(path)
    wanted: dict[str, Tensor] = dict(model.named_parameters())  # tied weights appear once
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }
    for name, buf in model.named_buffers():
        if name not in non_persistent:
            wanted[name] = buf
    missing = []
    by_file: dict[str, list[tuple[str, str, Tensor]]] = {}
    for name, tensor in wanted.items():
        if zero(name):
            local_rows(tensor)[0].zero_()
            continue
        key = _file_key(name, files)
        if key is None:
            if name in non_persistent or not isinstance(tensor, nn.Parameter):
                continue  # a buffer the checkpoint does not hold keeps its built value
            missing.append(name)
            continue
        by_file.setdefault(files[key], []).append((name, key, tensor))
    if missing:
        raise KeyError(f"{path} has no tensor for {', '.join(missing[:5])}")
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for name, key, tensor in items:
                local, first = local_rows(tensor)
                stored = handle.get_slice(key)
                shape = tuple(stored.get_shape())
                if shape != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: the checkpoint has shape {shape}, the model {tuple(tensor.shape)}"
                    )
                if local.numel() == 0:
                    continue
                rows = stored[first : first + local.shape[0]] if shape else stored[:]
                local.copy_(rows)


# --------------------------------------------------------------------------- gradients, state


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients so that their global L2 norm is at most max_norm; returns the norm
    before clipping. With sharded (DTensor) gradients the norm is the whole model's: each
    rank's partial norm is reduced over the ranks before it is used."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def named_full_tensors(
    module: nn.Module, *, parameters: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """The module's state (or with parameters=True its parameters, tied ones once) as whole
    tensors, one at a time (a collective per sharded tensor: every rank must iterate). Keys
    are the module's own names."""
    from torch.distributed.tensor import DTensor

    source = module.named_parameters() if parameters else module.state_dict().items()
    for name, tensor in source:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def push_layouts(
    module: nn.Module, dtype: torch.dtype | None, bucket_bytes: int
) -> list[BucketLayout]:
    """The pushed parameters (pushed_parameters) in buckets of at most bucket_bytes in
    `dtype` (their own when None), each laid out in a flat buffer; the same on every rank
    (global shapes)."""
    from rlx.trainer.weights import BucketLayout, bucket_plan

    params = dict(pushed_parameters(module))
    if not params:
        return []
    dtype = dtype or next(iter(params.values())).dtype
    plan = bucket_plan(
        ((name, param.numel() * dtype.itemsize) for name, param in params.items()), bucket_bytes
    )
    return [
        BucketLayout.of([(name, tuple(params[name].shape)) for name in names], dtype)
        for names in plan
    ]


def _rows_of(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first row, rows) rank holds of a tensor FSDP2 shards over `ranks` (torch.chunk)."""
    per_rank = -(-rows // ranks)
    first = min(per_rank * rank, rows)
    return first, max(min(per_rank, rows - first), 0)


@torch.no_grad()
def fill_bucket(
    module: nn.Module, layout: BucketLayout, buffer: Tensor | None, device: torch.device
) -> Traffic:
    """Rank 0 (`buffer` given): the bucket's tensors, whole and in the layout's dtype, written
    into the buffer. Under FSDP every rank is called and sends its own rows, cast, straight
    into their place in rank 0's buffer (point to point on the training ranks' group): only
    rank 0 ever holds a whole tensor, and it copies just its own rows. Plain and DDP modules:
    rank 0 copies, the others have nothing to do. Returns what this rank moved."""
    from torch.distributed.tensor import DTensor

    from rlx.trainer.weights import Traffic, as_bytes, dtype_named

    params = dict(module.named_parameters())
    dtype = dtype_named(layout.dtype)
    views = layout.views(buffer) if buffer is not None else None
    traffic = Traffic()
    ops: list[Any] = []
    outgoing: list[Tensor] = []  # kept alive until the sends are done
    for index, name in enumerate(layout.names):
        param = params[name]
        if not isinstance(param, DTensor):
            if views is not None:
                views[index][1].copy_(param.detach())
                traffic.copied += views[index][1].numel() * dtype.itemsize
            continue
        local, first = local_rows(param)
        peers = param.device_mesh.mesh.flatten().tolist()  # global rank of each mesh rank
        if views is None:
            if local.numel():
                shard = local.detach().to(device=device, dtype=dtype).contiguous()
                outgoing.append(shard)
                ops.append(dist.P2POp(dist.isend, as_bytes(shard), peers[0], tag=index))
                traffic.sent += shard.numel() * dtype.itemsize
            continue
        target = views[index][1]
        target[first : first + local.shape[0]].copy_(local.detach())
        traffic.copied += local.numel() * dtype.itemsize
        for mesh_rank, peer in enumerate(peers):
            start, rows = _rows_of(param.shape[0], len(peers), mesh_rank)
            if peer == peers[0] or rows == 0:
                continue
            piece = target[start : start + rows]
            ops.append(dist.P2POp(dist.irecv, as_bytes(piece), peer, tag=index))
            traffic.received += piece.numel() * dtype.itemsize
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return traffic


def full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict[str, Tensor]:
    """Whole tensors on the host (on rank 0 only, unless rank0_only is False); a collective
    under FSDP, so every rank calls it."""
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, Tensor] = {}
    for name, tensor in named_full_tensors(module):
        if keep:
            out[name] = tensor.to("cpu")
    return out
