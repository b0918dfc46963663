"""The trainer's torch modules: policy, reference, critic (a causal LM's body plus a value
head), and the optimiser and learning-rate schedule that go with each trained one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlx.recipe.model import ModelSettings, OptimSettings
from rlx.trainer.model.attention import layout_inputs
from rlx.trainer.model.cpu_linear import use_onednn
from rlx.trainer.model.traits import traits
from rlx.trainer.packing import Layout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlx.trainer.learn.sharding import ShardSpec


FUSED_ADAM_DEVICES = ("cpu", "cuda")


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype forwards run in: 'auto' is bfloat16 on GPU and float32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def quiet_transformers() -> None:
    """No per-load progress bars or weight-initialisation chatter in a training log."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_causal_lm(
    settings: ModelSettings,
    path: str,
    device: torch.device,
    *,
    trainable: bool,
    shard: ShardSpec | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM on `device`. A trained model keeps float32 master weights on GPU (the
    forward runs in bf16: autocast, or FSDP's mixed precision); a frozen one is stored in the
    compute dtype. With settings.lora a trained model is the frozen base, in the compute
    dtype, wrapped by peft with float32 adapters drawn from `seed` (lora.py). With `shard`,
    FSDP2-sharded, each rank reading only its own rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.trainer.model import lora

    adapters = settings.lora if trainable else None
    dtype = compute_dtype(settings.dtype, device)
    storage = torch.float32 if trainable and device.type == "cuda" and not adapters else dtype
    if shard is None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=storage, trust_remote_code=settings.trust_remote_code
        ).to(device)
        if adapters is not None:
            model = lora.add_adapters(model, adapters)
    else:
        from rlx.trainer.learn.sharding import build_sharded

        config = AutoConfig.from_pretrained(path, trust_remote_code=settings.trust_remote_code)
        _prepare_config(config, settings, trainable)

        def build() -> nn.Module:
            model = AutoModelForCausalLM.from_config(
                config, dtype=storage, trust_remote_code=settings.trust_remote_code
            )
            return model if adapters is None else lora.add_adapters(model, adapters)

        model = build_sharded(build, path, shard, zero=lora.is_adapter)
    if adapters is not None:
        lora.init_adapters(model, seed)
    _prepare(model, settings, trainable)
    if shard is None and device.type == "cpu":
        use_onednn(model)  # where this CPU takes oneDNN: AVX-512 (cpu_linear.py)
    return model


def _prepare_config(config: Any, settings: ModelSettings, trainable: bool) -> None:
    if trainable and settings.gradient_checkpointing:
        config.use_cache = False


def _prepare(model: nn.Module, settings: ModelSettings, trainable: bool) -> None:
    if trainable:
        if settings.gradient_checkpointing:
            # Non-reentrant: works with FSDP2's hooks and with inputs that need no grad.
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.config.use_cache = False  # type: ignore[union-attr]
        model.train()
    else:
        model.eval().requires_grad_(False)


def autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """bf16/fp16 compute over float32 weights on GPU; a no-op where weights already have the
    compute dtype (CPU float32 runs)."""
    enabled = device.type == "cuda" and dtype != torch.float32
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


class ValueModel(nn.Module):
    """The critic: a causal LM's transformer body and a linear head giving one value per
    position. The head starts at zero, so the first advantages are the plain returns."""

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor,
        layout: Layout | None = None,
    ) -> Tensor:
        """Padded rows with their 2-D mask, or packed rows (rlx.trainer.packing) with a
        layout: PackedRows.attention (None or 4-D) and .layout. Never with a cache."""
        if layout is None:
            inputs = {"attention_mask": attention_mask}
        else:
            inputs = packed_attention(self.body, attention_mask, layout, input_ids.device)
        hidden = self.body(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **inputs
        ).last_hidden_state  # (B, L, H)
        head_dtype = self.value_head.weight.dtype
        return self.value_head(hidden.to(head_dtype)).squeeze(-1).float()  # (B, L)


def load_value_model(
    settings: ModelSettings,
    path: str,
    device: torch.device,
    *,
    shard: ShardSpec | None = None,
    seed: int = 0,
) -> ValueModel:
    """The critic from a causal LM's folder: its body, and a value head at zero. With
    settings.lora the body is frozen in the compute dtype with adapters (lora.py); the value
    head trains whole."""
    from transformers import AutoConfig, AutoModel

    from rlx.trainer.model import lora

    adapters = settings.lora
    dtype = compute_dtype(settings.dtype, device)
    if device.type == "cuda" and adapters is None:
        dtype = torch.float32
    if shard is None:
        body = AutoModel.from_pretrained(
            path, dtype=dtype, trust_remote_code=settings.trust_remote_code
        )
        hidden = body.config.hidden_size
        if adapters is not None:
            body = lora.add_adapters(body, adapters, task="FEATURE_EXTRACTION")
        critic = ValueModel(body, hidden).to(device)
    else:
        from rlx.trainer.learn.sharding import build_sharded

        config = AutoConfig.from_pretrained(path, trust_remote_code=settings.trust_remote_code)
        _prepare_config(config, settings, trainable=True)

        def build() -> ValueModel:
            body = AutoModel.from_config(
                config, dtype=dtype, trust_remote_code=settings.trust_remote_code
            )
            if adapters is not None:
                body = lora.add_adapters(body, adapters, task="FEATURE_EXTRACTION")
            return ValueModel(body, config.hidden_size)

        critic = build_sharded(
            build,
            path,
            shard,
            zero=lambda name: name.startswith("value_head") or lora.is_adapter(name),
        )
    if adapters is not None:
        lora.init_adapters(critic, seed)
    if settings.gradient_checkpointing:
        critic.body.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    if shard is None and device.type == "cpu":
        use_onednn(critic)
    return critic.train()


# --------------------------------------------------------------------------- forwards


def attention_for(model: nn.Module, attention: Tensor | None) -> Tensor | None:
    """PackedRows.attention ((k, 1, T, T), True where a position attends) in the form the
    model's attention implementation takes; None stays None (the position ids say it all)."""
    if attention is None:
        return None
    facts = traits(model)
    implementation = facts.attention
    if implementation == "sdpa":
        return attention
    if implementation != "eager":
        raise ValueError(f"rows sharing prompts need SDPA or eager attention, not {implementation}")
    dtype = facts.dtype
    scores = torch.zeros(attention.shape, dtype=dtype, device=attention.device)
    return scores.masked_fill(~attention, torch.finfo(dtype).min)


def packed_attention(
    model: nn.Module, attention: Tensor | None, layout: Layout, device: torch.device
) -> dict[str, Any]:
    """The attention keywords of a packed forward of `model` (a decoder body): its layout
    where it attends by segments (rlx.trainer.model.attention); else the 4-D mask of rows
    that share prompts in the form its attention takes, or None, from which transformers
    derives the block-diagonal mask (restarting position ids)."""
    if traits(model).attends_by_segments:
        return layout_inputs(layout, device)
    if attention is None and any(len(s[2]) > 1 for row in layout for s in row):
        raise ValueError("rows that share prompts need their 4-D mask for this model")
    return {"attention_mask": attention_for(model, attention)}


@torch.no_grad()
def sequence_logprob(model: nn.Module, prompt_ids: list[int], response_ids: list[int]) -> float:
    """Sum of log-probs (temperature 1) of response_ids after prompt_ids: the policy's side of
    the weight-sync probe (RolloutEngine.logprob_probe is the engines' side). no_grad, not
    inference mode: a sharded policy's gathered weights land in buffers FSDP2 writes again
    in training (the caller, Learner.probe, picks inference mode where that is safe)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + response_ids], device=device)  # (1, L)
    logits = model(input_ids=ids, use_cache=False).logits.float()  # (1, L, V)
    predicting = logits[0, len(prompt_ids) - 1 : -1]  # (R, V)
    logprobs = torch.log_softmax(predicting, dim=-1)  # (R, V)
    target = ids[0, len(prompt_ids) :]  # (R,)
    return float(logprobs.gather(1, target[:, None]).sum())


# --------------------------------------------------------------------------- optimisation


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Learning-rate factor after `step` optimiser steps: linear warm-up from 0, then constant,
    cosine or linear decay to 0 at total_steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown schedule {schedule!r}; valid: constant, cosine, linear")


def make_optimizer(
    module: nn.Module, settings: OptimSettings, lr: float, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters, and a schedule stepped once per training step."""
    params = [p for p in module.parameters() if p.requires_grad]
    # One fused kernel over all tensors instead of a loop of small ones per tensor; torch has
    # it for floating-point tensors on CPU and CUDA.
    fused = all(p.is_floating_point() and p.device.type in FUSED_ADAM_DEVICES for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
        fused=fused or None,
    )

    def factor(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=settings.warmup_steps,
            total_steps=total_steps,
            schedule=settings.schedule,
        )

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
