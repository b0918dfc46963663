"""What a loaded model is and can do, read in one place: `traits(model)` reads its
transformers config once (the attention implementation, the kinds of its layers, whether it
is recurrent) and answers from that what the learner and the HF engine ask of it: can it run
packed sequences, share a prompt among its responses, attend by segments, run the lean decode
step. Every other module asks these questions here instead of reading the config itself.

The model handed in may be a transformers model, a peft wrapper of one or the critic (a
ValueModel: its `body`); `transformers_model` is the one way to the transformers model
inside. A switch of the attention implementation (use_segment_attention) changes the traits:
read them again after it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Segment attention's name among transformers' attention implementations (attention.py).
SEGMENT_ATTENTION = "rlx_segments"
# What a config that names no attention implementation runs: transformers' own default.
DEFAULT_ATTENTION = "eager"
# Attention implementations that take a 4-D mask as it is: True/False (SDPA) or 0/-inf
# added to the scores (eager). Rows whose sequences share a prompt need one.
MASKED_ATTENTION = ("sdpa", "eager")
# Attention implementations of transformers that keep packed sequences apart when called with
# restarting position ids, no attention mask and no cache (see rlx.trainer.packing), and
# segment attention, which reads their layout.
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", SEGMENT_ATTENTION)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
# The decoder layers whose forward the lean decode step (decode.py) repeats (their attention,
# MLP and norms, as transformers 5 writes them): input norm, attention (q/k/v projections,
# optional per-head q/k norms, rotary, cache, scaled dot-product attention, output
# projection), a residual add, post-attention norm, gated MLP, a residual add.
DECODER_LAYERS = (
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
)
# Rotary embeddings whose frequencies change with the longest sequence seen: a table made
# once would not follow them.
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
# Attention implementations whose decode step is the scaled dot-product attention the lean
# step runs (segment attention is SDPA outside packed passes: attention.py).
DECODE_ATTENTION = ("sdpa", "eager", SEGMENT_ATTENTION)


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model of a causal LM, a peft wrapper of one, or a ValueModel."""
    inner = getattr(model, "body", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def attends_in_full(config: Any) -> bool:
    """Every layer attends to the whole sequence before it (no sliding window): what a
    prompt-and-own-response layout or mask describes."""
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    return kinds == {"full_attention"} and getattr(config, "sliding_window", None) is None


@dataclass(frozen=True)
class ModelTraits:
    """A model's facts (see traits) and the capabilities that follow from them."""

    wrapper: str  # the class of the model as loaded (a ValueModel's body): peft's, FSDP's
    name: str  # the class of the transformers model inside
    has_config: bool  # a transformers model: it has a config
    attention: str  # its attention implementation (DEFAULT_ATTENTION where none is named)
    layer_kinds: frozenset[str]  # its config's layer_types; empty where it lists none
    full_attention: bool  # attends_in_full: every layer over the whole sequence before it
    stateful: bool  # recurrent: its state runs along the sequence (transformers' _is_stateful)
    checkpointing: bool  # gradient checkpointing on (no cache while it trains)
    module: nn.Module = field(compare=False, repr=False)  # the transformers model

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """The dtype its forward computes in where autocast is off: its input embeddings'."""
        return self.module.get_input_embeddings().weight.dtype  # type: ignore[operator]

    @property
    def packing_obstacle(self) -> str | None:
        """Why the model cannot run packed sequences exactly, or None when it can: a recurrent
        ("stateful") model or one with linear-attention layers carries state across the
        sequences of a row, and an attention implementation other than SDPA, eager or
        FlashAttention may ignore the restarting position ids."""
        if not self.has_config:
            return f"{self.wrapper} has no transformers config"
        if self.stateful:
            return f"{self.wrapper} is recurrent (its state runs across the sequences of a row)"
        others = self.layer_kinds - {"full_attention", "sliding_attention"}
        if others:
            return f"{self.wrapper} has {sorted(others)[0]} layers, which packing would mix"
        if self.attention not in PACKABLE_ATTENTION:
            return (
                f"{self.wrapper} runs {self.attention} attention; packing is exact with "
                + ", ".join(PACKABLE_ATTENTION)
            )
        return None

    @property
    def varlen(self) -> bool:
        """FlashAttention's varlen kernels: packed rows cost nothing for a mask, so a pass is
        one row (transformers reads sequence starts from the position ids of a single row
        only)."""
        return self.attention in VARLEN_ATTENTION

    @property
    def shares_packed_prompts(self) -> bool:
        """Whether packed rows may run a prompt once for several responses (a layout or a 4-D
        mask of prompt-and-own-response): the model attends by segments, or its attention
        takes such a mask as it is, and every layer attends in full (a sliding window would
        need its own)."""
        if not self.has_config or self.packing_obstacle is not None:
            return False
        return self.full_attention and self.attention in (*MASKED_ATTENTION, SEGMENT_ATTENTION)

    @property
    def can_attend_by_segments(self) -> bool:
        """Whether use_segment_attention would switch the model: it runs SDPA (or already
        segment attention) and every layer attends in full (a sliding window would need its
        own pieces)."""
        return (
            self.has_config
            and self.attention in ("sdpa", SEGMENT_ATTENTION)
            and self.full_attention
        )

    @property
    def attends_by_segments(self) -> bool:
        """Whether the model takes a layout in packed forwards (use_segment_attention)."""
        return self.attention == SEGMENT_ATTENTION

    def shares_prefill(self, training: bool) -> bool:
        """Whether a prompt's keys and values can be computed once and extended by several
        continuations: attention models of transformers (not recurrent, "stateful" ones),
        and not while gradient checkpointing is on in training, which turns the cache off.
        training: the model's mode now."""
        if not self.has_config or self.stateful:
            return False
        return not (training and self.checkpointing)

    @functools.cached_property
    def decode_obstacle(self) -> str | None:
        """Why the lean decode step (decode.py) cannot run the model, or None when it can."""
        lm = self.module
        body = getattr(lm, "model", None)
        if not self.has_config or body is None or not hasattr(lm, "lm_head"):
            return f"{self.name} is not a transformers causal LM with a decoder body"
        layers = getattr(body, "layers", None)
        if not layers:
            return f"{self.name} has no decoder layers"
        kinds = {type(layer).__name__ for layer in layers}
        if not kinds <= set(DECODER_LAYERS):
            return f"{sorted(kinds - set(DECODER_LAYERS))[0]} is not a decoder layer it knows"
        if not self.full_attention:  # Mistral's default window of 4096 included
            return f"{self.name} has layers that are not full attention"
        rotary = getattr(body, "rotary_emb", None)
        rope = getattr(rotary, "rope_type", None)
        if rotary is None or rope is None or any(kind in rope for kind in SEQUENCE_DEPENDENT_ROPE):
            return f"its rotary embedding ({rope}) changes with the sequence"
        if self.attention not in DECODE_ATTENTION:
            return f"it runs {self.attention} attention"
        if getattr(lm.config, "pretraining_tp", 1) != 1:
            return "it splits its projections (pretraining_tp)"
        if any(type(p).__name__ == "DTensor" for p in lm.parameters()):
            return "its weights are sharded (FSDP gathers them in its forward hooks)"
        return None


def traits(model: nn.Module) -> ModelTraits:
    """The traits of `model` (a transformers model, a peft wrapper of one, or a ValueModel),
    read from its config as it is now."""
    handed = getattr(model, "body", model)
    inner = transformers_model(model)
    config = getattr(inner, "config", None)
    return ModelTraits(
        wrapper=type(handed).__name__,
        name=type(inner).__name__,
        has_config=config is not None,
        attention=getattr(config, "_attn_implementation", None) or DEFAULT_ATTENTION,
        layer_kinds=frozenset(getattr(config, "layer_types", None) or ()),
        full_attention=attends_in_full(config),
        stateful=bool(getattr(inner, "_is_stateful", False)),
        checkpointing=bool(getattr(inner, "is_gradient_checkpointing", False)),
        module=inner,
    )
