"""The arithmetic of the memory plan: small pure functions, each stating its formula.

Symbols: N parameters, H hidden size, L layers, I intermediate size, V vocabulary, kv the
key/value width (kv heads x head dim), T tokens in a micro-batch, b bytes per element of
the compute dtype. Results are bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from rlx.plan.shapes import ModelShape

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq, each in the parameter's dtype
# Gathered decoder layers alive at once under FSDP2: the running one and the prefetched one.
FSDP_LAYERS_IN_FLIGHT = 2
# The trainer's log-probs run the LM head over this many bytes of fp32 logits at a time
# (the trainer's ResponseScorer chunks by chunk_tokens_for_vocab).
LOGITS_CHUNK_BYTES = 1 << 28
# FSDP2 reduces gradients in float32 (the trainer's MixedPrecisionPolicy reduce_dtype).
REDUCE_DTYPE = "float32"

# Accelerator memory in GiB as the device reports it, by the names resources.accelerators uses
# (SkyPilot's); not the maker's GB, which overstates a 24 GB card by 7% read as GiB. Sources,
# best first: CUDA's total memory (torch.cuda.get_device_properties().total_memory) measured
# here; else nvidia-smi's memory.total in MiB as quoted in public issues (it reads about
# 0.5 GiB above CUDA's: 81559 MiB against 79.18 GiB on an H100); else the maker's GB
# converted (GB * 1e9 / 2**30), marked "maker's", a floor where nothing better was found.
_MAKER = 1e9 / GIB  # GiB per maker's GB
ACCELERATOR_GIB: dict[str, float] = {
    "H100": 79.18,  # torch total_memory on an H100 80GB HBM3, measured here (81559 MiB)
    "H100-SXM": 79.18,  # the same device
    "H100-MEGA": 79.18,  # GCP a3-mega: the same H100 80GB HBM3
    "H100-NVL": 95830 / 1024,  # nvidia-smi: NVIDIA/gpu-admin-tools#4
    "H200": 143771 / 1024,  # nvidia-smi on an H200, measured here
    "GH200": 96 * _MAKER,  # maker's 96 GB
    "B200": 183359 / 1024,  # nvidia-smi: NVIDIA/TensorRT-LLM#10278
    "A100": 40960 / 1024,  # nvidia-smi, A100 40GB: modal-labs/modal-client#2797
    "A100-40GB": 40960 / 1024,  # as A100
    "A100-80GB": 81920 / 1024,  # nvidia-smi: modal-labs/modal-client#2797
    "L40S": 46068 / 1024,  # nvidia-smi: modal-labs/modal-client#2797
    "L40": 48 * _MAKER,  # maker's 48 GB
    "L4": 23034 / 1024,  # nvidia-smi: modal-labs/modal-client#2797
    "A10G": 23028 / 1024,  # nvidia-smi: NVIDIA/DCGM#232
    "A10": 23028 / 1024,  # nvidia-smi: modal-labs/modal-client#2797
    "A40": 48 * _MAKER,  # maker's 48 GB
    "RTXA6000": 48 * _MAKER,  # maker's 48 GB
    "RTX6000-ADA": 48 * _MAKER,  # maker's 48 GB
    "RTX4090": 24564 / 1024,  # nvidia-smi: RLinf/RLinf#255
    "V100": 16 * _MAKER,  # maker's 16 GB
    "V100-32GB": 32 * _MAKER,  # maker's 32 GB
    "T4": 15360 / 1024,  # nvidia-smi: modal-labs/modal-client#2797
    "MI300X": 192 * _MAKER,  # maker's 192 GB
}


# Memory of accelerators the table lacks, for custom hardware: 'NAME=GIB[,NAME=GIB...]'.
ACCELERATOR_GIB_ENV = "RLX_ACCELERATOR_GIB"


def accelerator_gib(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """GiB of one accelerator by name (case-insensitive): the table's, or one that
    RLX_ACCELERATOR_GIB in env (os.environ when None) gives ('MYGPU=96'); None when
    neither knows it."""
    env = os.environ if env is None else env
    table = {key.upper(): value for key, value in ACCELERATOR_GIB.items()}
    for entry in env.get(ACCELERATOR_GIB_ENV, "").split(","):
        key, _, size = entry.partition("=")
        try:
            table[key.strip().upper()] = float(size)
        except ValueError:
            continue
    return table.get(name.upper())


# How CUDA names the table's accelerators (torch.cuda.get_device_properties(i).name), most
# specific first: the table's name is the first whose words all appear in the device's name.
_DEVICE_WORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GH200", ("GH200",)),
    ("H200", ("H200",)),
    ("H100-NVL", ("H100", "NVL")),
    ("H100", ("H100",)),
    ("B200", ("B200",)),
    ("A100-80GB", ("A100", "80GB")),
    ("A100-40GB", ("A100", "40GB")),
    ("A100", ("A100",)),
    ("L40S", ("L40S",)),
    ("L40", ("L40",)),
    ("L4", ("L4",)),
    ("A10G", ("A10G",)),
    ("A10", ("A10",)),
    ("A40", ("A40",)),
    ("RTX6000-ADA", ("RTX", "6000", "ADA")),
    ("RTXA6000", ("RTX", "A6000")),
    ("RTX4090", ("RTX", "4090")),
    ("V100-32GB", ("V100", "32GB")),
    ("V100", ("V100",)),
    ("T4", ("T4",)),
    ("MI300X", ("MI300X",)),
)


def device_accelerator(device_name: str) -> str | None:
    """The table's name for a device as CUDA names it ('NVIDIA H100 80GB HBM3' -> 'H100',
    'NVIDIA A100-SXM4-40GB' -> 'A100-40GB'), or None for a device the table lacks."""
    words = set(re.split(r"[\s_-]+", device_name.upper()))
    for name, needed in _DEVICE_WORDS:
        if all(word in words for word in needed):
            return name
    return None


def runs_as(strategy: str, ranks: int) -> str:
    """The strategy as the formulas read it: 'single', 'ddp' or 'fsdp', the answer of
    rlx.plan.strategy.choose_strategy; one rank is always a plain module. 'auto' is refused:
    it is decided there, before any formula is asked."""
    if strategy not in ("single", "ddp", "fsdp"):
        raise ValueError(f"strategy {strategy!r}: pass the one choose_strategy decided")
    return "single" if ranks <= 1 else strategy


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
    mode = runs_as(strategy, ranks)
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
    return frozen_bytes(shape.params, ranks=ranks, strategy=strategy, dtype=dtype)


def frozen_bytes(params: int, *, ranks: int, strategy: str, dtype: str) -> int:
    """Frozen weights (a reference, a LoRA base) stored in the compute dtype: N*b, divided
    by `ranks` under FSDP, whole under DDP (no gradient buckets: nothing to reduce)."""
    mode = runs_as(strategy, ranks)
    return _ceil_div(params, ranks if mode == "fsdp" else 1) * DTYPE_BYTES[dtype]


def gathered_params_bytes(
    shape: ModelShape,
    *,
    strategy: str,
    ranks: int,
    dtype: str,
    reshard_after_forward: bool,
    extra_layer_params: int = 0,
) -> int:
    """FSDP2's all-gathered (unsharded) parameters in the compute dtype while a model runs:
    the root's (embeddings, LM head: never resharded between forward and backward) plus
    FSDP_LAYERS_IN_FLIGHT layers, or every layer when reshard_after_forward is off:
    (root + k*(layer + e))*b, e: a layer's extra parameters (its LoRA adapters). Zero
    without FSDP (the weights are whole already)."""
    if runs_as(strategy, ranks) != "fsdp":
        return 0
    layers = min(FSDP_LAYERS_IN_FLIGHT if reshard_after_forward else shape.layers, shape.layers)
    per_layer = shape.layer_params + extra_layer_params
    return (shape.root_params + layers * per_layer) * DTYPE_BYTES[dtype]


def root_grad_bytes(
    shape: ModelShape,
    *,
    strategy: str,
    ranks: int,
    dtype: str,
    params: int | None = None,
    trained_root: int | None = None,
) -> int:
    """FSDP2's backward of the root (embeddings and LM head, or the critic's value head):
    its unsharded gradients in the compute dtype, held from the LM head's backward to the
    embeddings', and the float32 copy the reduce-scatter takes as input: R*(b + 4), R*4 when
    the compute dtype is float32 already (R: root parameters; params overrides N, as in
    training_state_bytes; trained_root overrides R where only part of the root trains, as
    with LoRA: none of the policy's, the critic's value head). Zero without FSDP (DDP's
    gradients are the resident ones)."""
    if runs_as(strategy, ranks) != "fsdp":
        return 0
    total = shape.params if params is None else params
    root = total - shape.layers * shape.layer_params if trained_root is None else trained_root
    b = DTYPE_BYTES[dtype]
    return root * (b + (DTYPE_BYTES[REDUCE_DTYPE] if dtype != REDUCE_DTYPE else 0))


def layer_activation_bytes_per_token(
    shape: ModelShape, dtype: str, residual_dtype: str | None = None
) -> int:
    """What one decoder layer saves for backward per token (SDPA attention, no dropout), q
    the query width (heads x head dim). In the compute dtype: the attention norm's output,
    q, k and v repeated to every query head (transformers' SDPA path repeats them wherever a
    mask is passed, and packed and padded passes always pass one), SDPA's output and the
    copy o_proj reads, the MLP norm's output, gate, up, SiLU(gate) and their product; in
    float32 the two RMSNorm inputs they upcast and, where the residual stream is float32 (a
    whole float32 module under autocast), each norm's normalised float32 product, which the
    norm's weight multiplies: b*(2H + 5q + 4I) + 4*2H (+ 4*2H). Measured on an H100 at
    Qwen2.5-1.5B's shape without checkpointing (docs/gpu.md), the earlier count (k and v at
    their own width, no SDPA output, no normalised copy) left out a fifth of it."""
    b = DTYPE_BYTES[dtype]
    q = shape.heads * shape.head_dim
    normalised = 2 * shape.hidden * 4 if residual_dtype == "float32" else 0
    return b * (2 * shape.hidden + 5 * q + 4 * shape.intermediate) + 8 * shape.hidden + normalised


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    dtype: str,
    residual_dtype: str,
    checkpointing: bool,
    extra_per_token: int = 0,
) -> int:
    """Saved activations of one micro-batch of T tokens. Without checkpointing every layer
    keeps its own: T*L*a (a: layer_activation_bytes_per_token, plus extra_per_token, what a
    layer's LoRA adapters save). With (non-reentrant, per layer) checkpointing each layer
    keeps only its input, the residual stream, and one layer is recomputed at a time:
    T*L*H*r + T*a (r: bytes of the residual stream)."""
    per_layer = layer_activation_bytes_per_token(shape, dtype, residual_dtype) + extra_per_token
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
    """The LM head's peak for T_r response tokens, in the backward: the logits and their
    gradient in the compute dtype, and in float32 the upcast logits, their log-softmax and
    the gradients of both, V*(2b + 16) bytes per token (20 in bfloat16). Chunked (each chunk
    recomputed in the backward): C = min(chunk_tokens, T_r) tokens at a time; whole
    (chunk_tokens None): all T_r."""
    tokens = response_tokens if chunk_tokens is None else min(chunk_tokens, response_tokens)
    return tokens * shape.vocab * (2 * DTYPE_BYTES[dtype] + 16)


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
