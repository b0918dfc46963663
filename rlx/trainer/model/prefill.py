"""A prompt's prefill shared among the rows that hold it: GRPO's n samples of a prompt run
it once, and every row extends its keys and values. The learner's scorer and the HF engine's
prefill both take this path."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


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


def shared_prompt_cache(
    model: nn.Module, groups: tuple[Tensor, Tensor], prompt_ids: Tensor, prompt_mask: Tensor
) -> tuple[Any, Tensor]:
    """Run each distinct prompt through `model` once and give every row its prompt's keys
    and values: (the cache, each row's output at its last prompt position: (B, 1, V) logits
    of a causal LM, or (B, 1, H) hidden state of a decoder body)."""
    from transformers import DynamicCache

    first, inverse = groups
    positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, P) as SequenceBatch's
    cache = DynamicCache(config=model.config)
    inputs: dict[str, Any] = {
        "input_ids": prompt_ids[first],
        "attention_mask": prompt_mask[first],
        "position_ids": positions[first],
        "past_key_values": cache,
        "use_cache": True,
    }
    is_lm = getattr(model, "get_output_embeddings", lambda: None)() is not None
    if is_lm:
        head = model(**inputs, logits_to_keep=1).logits  # (U, 1, V)
    else:
        head = model(**inputs).last_hidden_state[:, -1:]  # (U, 1, H)
    cache.batch_select_indices(inverse)  # indexing: gradients flow back to the U prompts
    return cache, head[inverse]
