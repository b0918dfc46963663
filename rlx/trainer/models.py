"""The trainer's torch modules: policy, reference, critic (a causal LM's body plus a value
head), and the optimiser and learning-rate schedule that go with each trained one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlx.recipe.model import ModelSettings, OptimSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlx.trainer.batching import SequenceBatch


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
    settings: ModelSettings, path: str, device: torch.device, *, trainable: bool
) -> PreTrainedModel:
    """A causal LM on `device`. A trained model keeps float32 master weights on GPU (the
    forward runs under bf16 autocast, see autocast()); a frozen one is stored in the compute
    dtype."""
    from transformers import AutoModelForCausalLM

    dtype = compute_dtype(settings.dtype, device)
    storage = torch.float32 if trainable and device.type == "cuda" else dtype
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=storage, trust_remote_code=settings.trust_remote_code
    ).to(device)
    if trainable:
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model


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

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # (B, L, H)
        head_dtype = self.value_head.weight.dtype
        return self.value_head(hidden.to(head_dtype)).squeeze(-1).float()  # (B, L)


def load_value_model(settings: ModelSettings, path: str, device: torch.device) -> ValueModel:
    from transformers import AutoModel

    body = AutoModel.from_pretrained(
        path,
        dtype=torch.float32 if device.type == "cuda" else compute_dtype(settings.dtype, device),
        trust_remote_code=settings.trust_remote_code,
    )
    if settings.gradient_checkpointing:
        body.gradient_checkpointing_enable()
    critic = ValueModel(body, body.config.hidden_size).to(device)
    return critic.train()


# --------------------------------------------------------------------------- forwards


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """Rows that hold the same prompt (same tokens, same padding), as (first row of each
    distinct prompt (U,), which distinct prompt each row holds (B,)); None when no prompt
    repeats. prompt_ids, prompt_mask: (B, P)."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # (B, 2P)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)  # (U, 2P), (B,)
    if len(distinct) == len(rows):
        return None
    order = torch.arange(len(rows), device=rows.device)  # (B,)
    first = torch.full((len(distinct),), len(rows), device=rows.device, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, order, reduce="amin")  # (U,)
    return first, inverse


def can_share_prompts(model: nn.Module) -> bool:
    """Whether a prompt's keys and values can be computed once and extended by several
    continuations: attention models of transformers (not recurrent, "stateful" ones), and not
    while gradient checkpointing is on in training, which turns the cache off."""
    if not hasattr(model, "config") or getattr(model, "_is_stateful", False):
        return False
    return not (model.training and getattr(model, "is_gradient_checkpointing", False))


def shared_prompt_cache(
    model: nn.Module, groups: tuple[Tensor, Tensor], prompt_ids: Tensor, prompt_mask: Tensor
) -> tuple[Any, Tensor]:
    """Run each distinct prompt through `model` once and give every row its prompt's keys
    and values: (the cache, (B, 1, V) logits of each row's last prompt position)."""
    from transformers import DynamicCache

    first, inverse = groups
    positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, P) as SequenceBatch's
    cache = DynamicCache(config=model.config)
    head = model(
        input_ids=prompt_ids[first],
        attention_mask=prompt_mask[first],
        position_ids=positions[first],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits  # (U, 1, V)
    cache.batch_select_indices(inverse)  # indexing: gradients flow back to the U prompts
    return cache, head[inverse]


class ResponseLogits(nn.Module):
    """A causal LM as a function of a SequenceBatch's tensors: the logits that predict each
    response token, (B, R, V). Only the positions that predict a response token go through
    the LM head.

    Rows that hold the same prompt (GRPO's n samples per prompt) run it once: the distinct
    prompts go through the model first, each row gets its prompt's keys and values, and only
    the responses run on top. The prompt's share of the work is paid per prompt, not per
    sample, and gradients flow back through the shared keys and values, so the result is a
    full forward's up to float rounding. Under DDP wrap this module, not the LM: the two
    passes are then one forward to DDP.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_width: int
    ) -> Tensor:
        width = input_ids.shape[1] - prompt_width  # R
        groups = None
        if prompt_width > 0 and width > 0 and can_share_prompts(self.lm):
            groups = prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
        if groups is None:
            logits = self.lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=width + 1,
                use_cache=False,
            ).logits  # (B, R + 1, V)
            return logits[:, :-1]  # (B, R, V): position P - 1 + t predicts response token t
        cache, head = shared_prompt_cache(
            self.lm, groups, input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        )  # head (B, 1, V) predicts response token 0
        if width == 1:
            return head
        tail = self.lm(
            input_ids=input_ids[:, prompt_width:-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, prompt_width:-1],
            past_key_values=cache,
            use_cache=True,
        ).logits  # (B, R - 1, V) predict response tokens 1..R-1
        return torch.cat([head, tail], dim=1)  # (B, R, V)


def response_logits(scorer: nn.Module, batch: SequenceBatch) -> Tensor:
    """(B, R, V) logits predicting each response token, from a ResponseLogits (or DDP of one)."""
    return scorer(batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_width)


def response_values(critic: nn.Module, batch: SequenceBatch) -> Tensor:
    """V(state before response token t) for every t: (B, R)."""
    values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)  # (B, P + R)
    return values[:, batch.prompt_width - 1 : -1]  # (B, R)


@torch.inference_mode()
def sequence_logprob(model: nn.Module, prompt_ids: list[int], response_ids: list[int]) -> float:
    """Sum of log-probs (temperature 1) of response_ids after prompt_ids: the policy's side of
    the weight-sync probe (RolloutEngine.logprob_probe is the engines' side)."""
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
