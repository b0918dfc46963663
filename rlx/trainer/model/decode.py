"""One decode step of a Llama-family causal LM, run from its weights without transformers'
module machinery, and the key/value cache the HF engine's sampling loop decodes into.

On a small model a decode step through transformers' forward is mostly per-call work, not
arithmetic: module calls and hooks, the 4-D mask rebuilt from the 2-D one, the rotary
embedding recomputed, output dataclasses, for every layer and every token. This step does
the same arithmetic on the same tensors (the model's own parameters, so an update or a
weight push is seen at the next generation, and the cache the engine's prefill filled) in
fewer calls: the rotary table made once per generation, q/k/v as one projection (their
weights concatenated per generation), q and k rotated together, the norms fused in float32.

Which models (ModelTraits.decode_obstacle, traits.py): decoder layers of the classes in
DECODER_LAYERS (Llama, Mistral, Qwen2, Qwen3), every layer full attention, a rotary
embedding that does not depend on the sequence seen (not dynamic NTK or LongRoPE), SDPA,
eager or segment attention, and plain tensors (a model sharded by FSDP gathers its weights
in module hooks: it runs transformers' forward).
Projections that are not plain linear layers (LoRA adapters of peft) are called as modules, so
they keep their own forward. `LeanDecoder.check` compares the step with transformers'
forward on a few tokens before an engine uses it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlx.trainer.model.cpu_linear import (
    choice,
    is_linear,
    onednn_linear,
    plain,
    reorder_weight,
    runs_onednn,
)
from rlx.trainer.model.traits import ModelTraits, traits, transformers_model

# How far the step's logits may stray from transformers' forward, relative to the largest
# logit (at least 1), by the dtype the check runs in: rounding of the same ops in a
# different order, far below a wrong mask's or a wrong position's.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
CHECK_TOLERANCE_LOW = 2e-2  # half precision
# Where oneDNN runs the CPU's linears, a generation packs the projections' weights into its
# layout (a copy of them, held while it decodes) when they come to at most this much.
PACK_LIMIT = 128 * 2**20


@functools.cache
def _growing_layer_class() -> type:
    """A full-attention cache layer that keeps its keys and values in a buffer with room
    to spare and writes each step's into it, where transformers' DynamicLayer copies the
    whole cache (torch.cat) at every token: on a small model that copy was most of a decode
    step, and it grows with the length. The layer hands attention a view of the filled part;
    when the buffer is full it doubles (up to the room the generation can need), so memory
    stays within twice what is held, as the copy's transient did."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, most: int):
            super().__init__()
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True
            self.most = most  # no row ever holds more positions than this
            self.filled = keys.shape[-2]
            self._keys = self._room(keys, min(most, max(2 * self.filled, 64)))
            self._values = self._room(values, self._keys.shape[-2])
            self._views()

        def _room(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
            """(B, H, capacity, D), the first `filled` positions copied from `states`."""
            rows, heads, _, dim = states.shape
            buffer = states.new_empty((rows, heads, capacity, dim))
            buffer[:, :, : self.filled] = states[:, :, : self.filled]
            return buffer

        def _views(self) -> None:
            self.keys = self._keys[:, :, : self.filled]
            self.values = self._values[:, :, : self.filled]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
        ) -> tuple[torch.Tensor, torch.Tensor]:
            end = self.filled + key_states.shape[-2]
            if end > self._keys.shape[-2]:
                capacity = max(end, min(self.most, 2 * self._keys.shape[-2]))
                self._keys = self._room(self._keys, capacity)
                self._values = self._room(self._values, capacity)
            self._keys[:, :, self.filled : end] = key_states
            self._values[:, :, self.filled : end] = value_states
            self.filled = end
            self._views()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._keys = self._keys[indices]
            self._values = self._values[indices]
            self._views()

    return GrowingLayer


def grow_in_place(cache: object, most: int) -> None:
    """Make every plain full-attention layer of a DynamicCache write new positions into a
    buffer instead of concatenating (see _growing_layer_class); other layers (sliding
    windows, linear attention) stay as they are. `most`: the positions a row can reach."""
    from transformers.cache_utils import DynamicLayer

    growing = _growing_layer_class()
    layers = getattr(cache, "layers", [])
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            layers[index] = growing(layer.keys, layer.values, most)


Product = Callable[[Tensor], Tensor]  # x (..., in) -> x W^T + b (..., out)


def _product(weight: Tensor, bias: Tensor | None, rows: int, pack: bool) -> Product:
    """x W^T + b over weights that stay as they are for a generation, as the process's CPU
    linears run it (cpu_linear.py): where that is oneDNN, with the weight reordered once
    into oneDNN's own layout when `pack` (a copy the size of the weight: a small model's
    decode step runs its products about twice as fast so, measured at 1 to 16 rows), else
    read as it is; elsewhere F.linear. rows: how many the generation starts with."""
    if choice() != "onednn" or not (plain(weight) and plain(bias)):
        return lambda x: F.linear(x, weight, bias)
    kept = reorder_weight(weight, rows) if pack else weight

    def product(x: Tensor) -> Tensor:
        if runs_onednn(x, weight, bias):
            return onednn_linear(x, kept, bias)
        return F.linear(x, weight, bias)

    return product


Parts = Callable[[Tensor], list[Tensor]]  # x -> each projection's output, in order


def _parts(modules: list[nn.Module], rows: int, pack: bool, join: bool) -> Parts:
    """The projections' outputs from x: with `join`, as one product over their weights
    concatenated now (split after), where every one is a plain linear layer and all or none
    have a bias; else a product each."""
    biases = [m.bias if is_linear(m) else None for m in modules]
    if (
        join
        and all(is_linear(m) for m in modules)
        and (all(b is None for b in biases) or not any(b is None for b in biases))
    ):
        weight = torch.cat([m.weight for m in modules])  # (sum of outs, in)
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        product = _product(weight, bias, rows, pack)
        sizes = [m.weight.shape[0] for m in modules]
        return lambda x: list(product(x).split(sizes, dim=-1))
    products = [_single(m, rows, pack) for m in modules]
    return lambda x: [one(x) for one in products]


def _single(module: nn.Module, rows: int, pack: bool) -> Product:
    """A projection's product: over its weights for a plain linear layer (packed when
    `pack`, a copy), else the module itself (a peft LoRA layer adds its adapters in its
    own forward)."""
    if is_linear(module):
        return _product(module.weight, module.bias, rows, pack)
    return module


def _rms_norm(module: nn.Module) -> Any:
    """The norm's forward without the module call: as transformers writes it (float32
    variance, the weight applied in the input's dtype), or in float32 with autocast off, where
    that is the same arithmetic, torch's fused rms_norm (one call instead of eight)."""
    eps = module.variance_epsilon

    def norm(x: Tensor) -> Tensor:
        weight = module.weight
        if (
            x.dtype == torch.float32
            and weight.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type)
        ):
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    return norm


@dataclass(frozen=True)
class _Layer:
    attention: nn.Module  # its projections are read again each generation
    mlp: nn.Module
    norm_in: Any
    q_norm: Any  # None: no per-head norm (Qwen3 has one)
    k_norm: Any
    norm_post: Any
    act: Any


@dataclass(frozen=True)
class _Projections:
    """One layer's products for a generation (see LeanDecoder.prepare)."""

    qkv: Parts  # q, k, v
    o: Product
    gate_up: Parts  # gate, up
    down: Product


@dataclass(frozen=True)
class Generation:
    """What one generation's decode steps read, made by LeanDecoder.prepare: the rotary
    tables of its positions and each layer's products over the weights as they are now."""

    cos: Tensor  # (positions, D)
    sin: Tensor  # (positions, D) with the first half negated (see _rotate)
    layers: list[_Projections]
    head: Product


class LeanDecoder:
    """Decode steps of a supported model (ModelTraits.decode_obstacle); build with
    `for_model`."""

    def __init__(self, model: nn.Module):
        lm = transformers_model(model)
        body = lm.model
        config = lm.config
        self.rotary = body.rotary_emb
        self.embed = body.embed_tokens
        self.norm = _rms_norm(body.norm)
        self.lm_head = lm.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        first = body.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.layers = [
            _Layer(
                attention=layer.self_attn,
                mlp=layer.mlp,
                norm_in=_rms_norm(layer.input_layernorm),
                q_norm=_rms_norm(layer.self_attn.q_norm)
                if hasattr(layer.self_attn, "q_norm")
                else None,
                k_norm=_rms_norm(layer.self_attn.k_norm)
                if hasattr(layer.self_attn, "k_norm")
                else None,
                norm_post=_rms_norm(layer.post_attention_layernorm),
                act=layer.mlp.act_fn,
            )
            for layer in body.layers
        ]
        linears = [m for m in lm.modules() if is_linear(m)]
        size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        self.pack = size <= PACK_LIMIT

    @classmethod
    def for_model(
        cls, model: nn.Module, facts: ModelTraits | None = None
    ) -> tuple[LeanDecoder | None, str | None]:
        """(a decoder, None), or (None, why not) when the model is not one it runs. facts:
        the model's traits where the caller holds them."""
        reason = (facts or traits(model)).decode_obstacle
        return (None, reason) if reason else (cls(model), None)

    def prepare(self, positions: int, rows: int) -> Generation:
        """What a generation of up to `positions` positions over `rows` rows reads (once per
        generation, after any weight change): the rotary tables as the rotary module
        computes them for those positions, in the embeddings' dtype, and each layer's
        products (q/k/v as one; weights packed for oneDNN where it runs them and the model
        is small, PACK_LIMIT, and then gate/up as one too: _product)."""
        like = self.embed.weight
        ids = torch.arange(positions, device=like.device)[None]  # (1, T)
        cos, sin = self.rotary(like, ids)  # (1, T, D) each
        half = sin.shape[-1] // 2
        signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # (T, D)
        layers = []
        for layer in self.layers:
            attention, mlp = layer.attention, layer.mlp
            qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
            layers.append(
                _Projections(
                    qkv=_parts(qkv, rows, self.pack, join=True),
                    o=_single(attention.o_proj, rows, self.pack),
                    # gate and up as one only where packing copies them anyway (small models)
                    gate_up=_parts([mlp.gate_proj, mlp.up_proj], rows, self.pack, join=self.pack),
                    down=_single(mlp.down_proj, rows, self.pack),
                )
            )
        head = _single(self.lm_head, rows, self.pack)
        return Generation(cos[0], signed, layers, head)

    def step(
        self,
        generation: Generation,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        cache: Any,
    ) -> Tensor:
        """(A, V) logits after one new token per row. input_ids, position_ids: (A, 1);
        attention_mask: (A, T) 1 where a cached or the new position is real (T: the cache's
        length after this step); cache: the engine's DynamicCache, written in place."""
        rows = input_ids.shape[0]
        dim = self.head_dim
        x = self.embed(input_ids)  # (A, 1, H)
        cos = generation.cos[position_ids].unsqueeze(1)  # (A, 1, 1, D)
        sin = generation.sin[position_ids].unsqueeze(1)
        mask = attention_mask.bool()[:, None, None, :]  # (A, 1, 1, T)
        gqa = self.kv_heads != self.heads
        for index, (layer, products) in enumerate(zip(self.layers, generation.layers, strict=True)):
            h = layer.norm_in(x)
            q, k, v = products.qkv(h)
            q = q.view(rows, 1, -1, dim)  # (A, 1, Hq, D)
            k = k.view(rows, 1, -1, dim)  # (A, 1, Hk, D)
            v = v.view(rows, 1, -1, dim).transpose(1, 2)  # (A, Hk, 1, D)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            # q and k rotated together: one pass of the rotary arithmetic, not two
            rotated = _rotate(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin)
            q, k = rotated.split([self.heads, self.kv_heads], dim=1)  # (A, Hq|Hk, 1, D)
            keys, values = cache.layers[index].update(k, v)  # (A, Hk, T, D) each
            attended = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
            )  # (A, Hq, 1, D)
            x = x + products.o(attended.transpose(1, 2).reshape(rows, 1, -1))
            h = layer.norm_post(x)
            gate, up = products.gate_up(h)
            x = x + products.down(layer.act(gate) * up)
        return generation.head(self.norm(x))[:, -1]  # (A, V)

    def tolerance(self) -> float:
        """How far check's gap may go for this model's dtype (CHECK_TOLERANCE)."""
        return CHECK_TOLERANCE.get(self.embed.weight.dtype, CHECK_TOLERANCE_LOW)

    @torch.no_grad()
    def check(self, model: nn.Module) -> float:
        """Run three decode steps over two left-padded rows and compare each step's logits
        with transformers' forward of the whole sequence: the largest difference relative to
        the largest logit (NaN stays NaN)."""
        from transformers import DynamicCache

        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        vocab = self.embed.weight.shape[0]
        ids = torch.randint(0, vocab, (2, 8), generator=generator).to(device)  # (2, 8)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # row 1: a prompt of 2 tokens after 3 of padding
        prompt = 5
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (2, 8)
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        cache = DynamicCache(config=transformers_model(model).config)
        model(
            input_ids=ids[:, :prompt],
            attention_mask=mask[:, :prompt],
            position_ids=positions[:, :prompt],
            past_key_values=cache,
            use_cache=True,
        )
        grow_in_place(cache, ids.shape[1])
        generation = self.prepare(ids.shape[1], ids.shape[0])
        gaps = []
        for t in range(prompt, ids.shape[1]):
            logits = self.step(
                generation, ids[:, t : t + 1], positions[:, t : t + 1], mask[:, : t + 1], cache
            )
            expected = whole[:, t]  # (2, V)
            scale = max(1.0, float(expected.abs().max()))
            gaps.append(float((logits - expected).abs().max()) / scale)
        return math.nan if any(math.isnan(g) for g in gaps) else max(gaps)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary position embedding as transformers applies it, x cos + rotate_half(x) sin, in
    fewer calls: rotate_half(x) = (-x2, x1) and x rolled by half is (x2, x1), so with sin's
    first half negated (signed_sin) the product is the same, element for element."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
