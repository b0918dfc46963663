"""Segment attention: packed rows attended by their layout instead of a dense mask.

A packed row (rlx.trainer.packing) holds segments one after another: a sequence alone, or a
prompt once with the responses that share it. With SDPA over a dense 4-D mask every position
of a row is scored against every other and most of the products are masked away: a response
sees only its prompt and itself, so at a few hundred tokens a row most of attention's work
was for nothing, and rows had to stay short (the mask grows with their square), leaving
padding at their tails. Here each piece runs on its own: a sequence (or a shared prompt)
causally, and each response of a segment on its prompt's keys and values followed by its own,
causally. That is the same arithmetic as the masked row, restricted to what the mask lets
through, so a pass can be one row of all its sequences, with no padding and no (T, T) mask.

It is an attention implementation of transformers (SEGMENT_ATTENTION, registered in its
AttentionInterface): a model switched to it (`use_segment_attention`) attends as SDPA does,
mask and all, in every forward that does not carry a layout (generation, probes, padded
passes), and by the layout in those that do (`layout_inputs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlx.trainer.model.traits import SEGMENT_ATTENTION, traits, transformers_model
from rlx.trainer.packing import Layout, Segment

# The keyword a packed forward hands its layout (PackedRows.layout) through transformers'
# model call to every attention layer.
LAYOUT_KEYWORD = "segment_layout"


@functools.cache
def register() -> None:
    """Make SEGMENT_ATTENTION an attention implementation transformers knows, with SDPA's
    mask making (for forwards without a layout)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, sdpa_mask)


def use_segment_attention(model: nn.Module) -> None:
    """Switch `model` (see ModelTraits.can_attend_by_segments) from SDPA to segment
    attention."""
    if not traits(model).can_attend_by_segments:
        raise ValueError(f"{type(model).__name__} cannot attend by segments")
    register()
    # On the config, which every attention layer reads at each call: the model's own
    # set_attn_implementation judges by its class's source, which FSDP2's wrapper hides.
    transformers_model(model).config._attn_implementation = SEGMENT_ATTENTION


def layout_inputs(layout: Layout, device: torch.device) -> dict[str, Any]:
    """The keywords of a packed forward over a model that attends by segments: the layout,
    and as the attention mask a 4-D one of a single True, which tells transformers the mask
    is made already (it would otherwise build the (T, T) one its position ids imply)."""
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    return {"attention_mask": placeholder, LAYOUT_KEYWORD: layout}


def segment_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention call: query (k, Hq, T, D), key and value (k, Hk, T, D) ->
    ((k, T, Hq, D), None). With a layout (LAYOUT_KEYWORD) each row's segments attend as
    described above and padding after them attends to itself alone; without one, SDPA."""
    layout: Layout | None = kwargs.pop(LAYOUT_KEYWORD, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if len(layout) != query.shape[0]:
        raise ValueError(f"a layout of {len(layout)} rows for {query.shape[0]} rows of queries")
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:  # grouped-query attention: every query head its key/value head
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    # Pieces by split, never by slicing: split's backward puts the pieces' gradients side
    # by side in one pass, where each slice's would fill a whole-row tensor of zeros first.
    rows = [
        _attend_row(q, k, v, segments, dropout, scaling)
        for q, k, v, segments in zip(
            query.split(1), key.split(1), value.split(1), layout, strict=True
        )
    ]
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]  # (k, Hq, T, D)
    return out.transpose(1, 2).contiguous(), None


def _pieces(segments: Sequence[Segment], width: int) -> list[int]:
    """The lengths a row splits into along its positions: each segment's prompt (where it
    has one) and each of its responses, then the padding after the last (if any)."""
    sizes: list[int] = []
    end = 0
    for start, prompt, responses in segments:
        if start != end:
            raise ValueError(f"a segment starts at {start}, the one before it ends at {end}")
        if len(responses) <= 1:  # one sequence: one piece
            sizes.append(prompt + sum(responses))
        else:
            sizes += [prompt, *responses]
        end = start + prompt + sum(responses)
    if end > width:
        raise ValueError(f"the segments reach position {end} of a row of {width}")
    return [*sizes, width - end]


def _attend_row(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: Sequence[Segment],
    dropout: float,
    scale: float | None,
) -> Tensor:
    """One row: q, k, v (1, H, T, D) -> (1, H, T, D)."""
    sizes = _pieces(segments, q.shape[2])
    qs, ks, vs = (t.split(sizes, dim=2) for t in (q, k, v))
    pieces: list[Tensor] = []
    index = 0
    for _, prompt, responses in segments:
        if len(responses) <= 1:  # one sequence: causal over all of it
            pieces.append(_causal(qs[index], ks[index], vs[index], dropout, scale))
            index += 1
            continue
        keys, values = ks[index], vs[index]  # (1, H, p, D): the prompt's
        pieces.append(_causal(qs[index], keys, values, dropout, scale))
        index += 1
        for length in responses:
            if length:
                # the prompt in full, then its own tokens causally: lower-right aligned
                allowed = torch.ones((length, prompt + length), dtype=torch.bool, device=q.device)
                pieces.append(
                    F.scaled_dot_product_attention(
                        qs[index],
                        torch.cat([keys, ks[index]], dim=2),
                        torch.cat([values, vs[index]], dim=2),
                        attn_mask=allowed.tril(prompt),
                        dropout_p=dropout,
                        scale=scale,
                    )
                )
            index += 1
    pieces.append(vs[index])  # padding: each position attends to itself alone
    pieces = [piece for piece in pieces if piece.shape[2]]
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _causal(q: Tensor, k: Tensor, v: Tensor, dropout: float, scale: float | None) -> Tensor:
    if q.shape[2] == 0:
        return q
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)
