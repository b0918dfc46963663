"""The arithmetic of the memory plan: small pure functions, each stating its formula.

Symbols: N parameters, H hidden size, L layers, I intermediate size, V vocabulary, kv the
key/value width (kv heads x head dim), T tokens in a micro-batch, b bytes per element of
the compute dtype. Results are bytes.
"""

from __future__ import annotations

from rlx.plan.shapes import ModelShape
from rlx.recipe.model import effective_strategy

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq, each in the parameter's dtype
# Gathered decoder layers alive at once under FSDP2: the running one and the prefetched one.
FSDP_LAYERS_IN_FLIGHT = 2
# The trainer's log-probs run the LM head over this many bytes of fp32 logits at a time
# (the trainer's ResponseScorer chunks by chunk_tokens_for_vocab).
LOGITS_CHUNK_BYTES = 1 << 28

# Accelerator memory in GiB, by the names resources.accelerators uses (SkyPilot's).
ACCELERATOR_GIB: dict[str, float] = {
    "H100": 80,
    "H100-SXM": 80,
    "H100-MEGA": 80,
    "H100-NVL": 94,
    "H200": 141,
    "GH200": 96,
    "B200": 180,
    "A100": 40,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "L40S": 48,
    "L40": 48,
    "L4": 24,
    "A10G": 24,
    "A10": 24,
    "A40": 48,
    "RTXA6000": 48,
    "RTX6000-ADA": 48,
    "RTX4090": 24,
    "V100": 16,
    "V100-32GB": 32,
    "T4": 16,
    "MI300X": 192,
}


def accelerator_gib(name: str) -> float | None:
    """GiB of one accelerator by name (case-insensitive), or None when unknown."""
    table = {key.upper(): value for key, value in ACCELERATOR_GIB.items()}
    return table.get(name.upper())


def training_state_bytes(
    shape: ModelShape,
    *,
    ranks: int,
    strategy: str,
    offload_optimizer: bool = False,
    param_dtype: str = "float32",
    params: int | None = None,
) -> dict[str, int]:
    """Per-rank bytes of a trained model's state: weights N*p, gradients N*p and AdamW's two
    moments 2*N*p (p: bytes of param_dtype), divided by `ranks` under FSDP; DDP adds its
    gradient buckets, a second N*p ("ddp_buckets"). "device" and "host" sum where they live:
    offload_optimizer (FSDP2 CPU offload) puts all of it in host memory.

    params overrides N (the critic's count for a critic of this shape)."""
    count = shape.params if params is None else params
    per = DTYPE_BYTES[param_dtype]
    mode = effective_strategy(strategy, ranks)
    share = ranks if mode == "fsdp" else 1
    weights = _ceil_div(count, share) * per
    out = {
        "weights": weights,
        "grads": weights,
        "optimizer": ADAM_MOMENTS * weights,
        "ddp_buckets": weights if mode == "ddp" else 0,
    }
    total = sum(out.values())
    out["device"], out["host"] = (0, total) if offload_optimizer else (total, 0)
    return out


def reference_bytes(shape: ModelShape, *, ranks: int, strategy: str, dtype: str) -> int:
    """The frozen reference policy, stored in the compute dtype: N*b, divided by `ranks`
    under FSDP."""
    mode = effective_strategy(strategy, ranks)
    return _ceil_div(shape.params, ranks if mode == "fsdp" else 1) * DTYPE_BYTES[dtype]


def gathered_params_bytes(
    shape: ModelShape, *, strategy: str, ranks: int, dtype: str, reshard_after_forward: bool
) -> int:
    """FSDP2's all-gathered (unsharded) parameters in the compute dtype while a model runs:
    the root's (embeddings, LM head: never resharded between forward and backward) plus
    FSDP_LAYERS_IN_FLIGHT layers, or every layer when reshard_after_forward is off:
    (root + k*layer)*b. Zero without FSDP (the weights are whole already)."""
    if effective_strategy(strategy, ranks) != "fsdp":
        return 0
    layers = FSDP_LAYERS_IN_FLIGHT if reshard_after_forward else shape.layers
    return (shape.root_params + min(layers, shape.layers) * shape.layer_params) * (
        DTYPE_BYTES[dtype]
    )


def layer_activation_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """What one decoder layer saves for backward per token (flash/SDPA attention, no
    dropout): in the compute dtype the attention norm's output, q, k, v, the attention
    output, the MLP norm's output, gate, up, SiLU(gate) and their product; in float32 the
    two RMSNorm inputs they upcast: b*(4H + 2kv + 4I) + 4*2H."""
    b = DTYPE_BYTES[dtype]
    return b * (4 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) + 8 * shape.hidden


def activation_bytes(
    shape: ModelShape, tokens: int, *, dtype: str, residual_dtype: str, checkpointing: bool
) -> int:
    """Saved activations of one micro-batch of T tokens. Without checkpointing every layer
    keeps its own: T*L*a (a: layer_activation_bytes_per_token). With (non-reentrant,
    per layer) checkpointing each layer keeps only its input, the residual stream, and one
    layer is recomputed at a time: T*L*H*r + T*a (r: bytes of the residual stream)."""
    per_layer = layer_activation_bytes_per_token(shape, dtype)
    if not checkpointing:
        return tokens * shape.layers * per_layer
    residual = tokens * shape.layers * shape.hidden * DTYPE_BYTES[residual_dtype]
    return residual + tokens * per_layer


def chunk_tokens_for_vocab(vocab: int) -> int:
    """Tokens per chunk of the chunked log-probs: LOGITS_CHUNK_BYTES of fp32 logits. The
    trainer's ResponseScorer chunks by this very function."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def logits_chunk_tokens(shape: ModelShape) -> int:
    return chunk_tokens_for_vocab(shape.vocab)


def logits_peak_bytes(
    shape: ModelShape, response_tokens: int, *, dtype: str, chunk_tokens: int | None
) -> int:
    """The LM head's peak for T_r response tokens. Chunked (each chunk recomputed in the
    backward): one chunk's logits in the compute dtype and float32, and their gradients,
    C*V*(2b + 8) with C = min(chunk_tokens, T_r). Whole (chunk_tokens None): the logits and
    their gradient in the compute dtype and a float32 copy with its log-softmax,
    T_r*V*(2b + 8)."""
    tokens = response_tokens if chunk_tokens is None else min(chunk_tokens, response_tokens)
    return tokens * shape.vocab * (2 * DTYPE_BYTES[dtype] + 8)


def kv_bytes_per_token(shape: ModelShape, *, dtype: str, tensor_parallel: int = 1) -> int:
    """KV cache per token on one GPU of an engine: 2 (K and V) * L * kv heads per GPU *
    head dim * b. KV heads split over tensor_parallel GPUs (replicated when fewer)."""
    heads = max(shape.kv_heads // tensor_parallel, 1)
    return 2 * shape.layers * heads * shape.head_dim * DTYPE_BYTES[dtype]


def engine_weight_bytes(shape: ModelShape, *, dtype: str, tensor_parallel: int = 1) -> int:
    """An inference engine's weights on one of its GPUs: N*b / tensor_parallel."""
    return _ceil_div(shape.params * DTYPE_BYTES[dtype], tensor_parallel)


def push_bucket_bytes(shape: ModelShape, *, dtype: str, bucket_bytes: int) -> int:
    """The largest bucket of a streamed weight push: bucket_bytes, or the largest tensor
    when it is bigger (it travels alone): the embedding, V*H*b."""
    return max(bucket_bytes, shape.vocab * shape.hidden * DTYPE_BYTES[dtype])


def checkpoint_bytes(params: int, critic_params: int, *, param_dtype: str) -> int:
    """One checkpoint on disk: each trained model's weights and AdamW moments,
    3*(N + N_critic)*p (the reference is the starting model and gradients are not saved)."""
    return 3 * (params + critic_params) * DTYPE_BYTES[param_dtype]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
