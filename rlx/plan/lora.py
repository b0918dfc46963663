"""LoRA's sizes from the model's shape and `trainer.model.lora`: which linear layers get an
adapter, how many parameters the adapters have (what the learner trains, checkpoints and
pushes), what they add to the activations, and what a vLLM engine sets aside to serve them.
Pure: no torch, no peft, no vLLM; the planner, lint and the trainer ask the same functions.

Symbols as in memory.py (H hidden, L layers, I intermediate, q the query width, kv the
key/value width), r the adapter's rank, s vLLM's rank slot (max_lora_rank), b bytes per
element. peft gives a linear layer of (in, out) an adapter A (r x in) and B (out x r).
"""

from __future__ import annotations

from rlx.plan.memory import DTYPE_BYTES
from rlx.plan.shapes import ModelShape
from rlx.recipe.model import ALL_LINEAR, LoraSettings, RolloutSettings

# The adapters' own dtype: peft keeps them in float32 over a bf16 base, and a push carries
# them as they are.
ADAPTER_DTYPE = "float32"

# The linear layers of one decoder layer under their parent module, in the layer's order, by
# the config's model_type: peft's names for them (and vLLM's before it packs q/k/v and
# gate/up). 'all-linear' is all of them; the output head is never adapted.
_LLAMA_LAYOUT = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
DECODER_LINEARS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2": _LLAMA_LAYOUT,
    "llama": _LLAMA_LAYOUT,
    "mistral": _LLAMA_LAYOUT,
    "qwen3": _LLAMA_LAYOUT,
}

# vLLM's valid max_lora_rank values (its LoRAConfig's MaxLoRARanks): an engine serves
# adapters up to the slot it was started with, and its slots' memory grows with it.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Tokens of vLLM's largest forward (its max_num_batched_tokens, left to vLLM): for its LLM
# class 16384 on GPUs of 70 GB and more (8192 below: counted as 16384), 4096 per
# tensor-parallel worker on CPU.
VLLM_GPU_BATCHED_TOKENS = 16384
VLLM_CPU_BATCHED_TOKENS = 4096


def layer_names(shape: ModelShape) -> tuple[str, ...] | None:
    """The linear layers of a decoder layer of this architecture, or None when the plan does
    not know its model_type."""
    layout = DECODER_LINEARS.get(shape.model_type)
    return None if layout is None else tuple(name for _, name in layout)


def linear_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a decoder layer (the layout every architecture of
    DECODER_LINEARS shares, and the one ModelShape counts parameters by)."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _matches(target: str, parent: str, name: str) -> bool:
    # peft adapts a module whose name ends with the target at a dot: 'q_proj' and
    # 'self_attn.q_proj' name every layer's q_proj.
    return target in (name, f"{parent}.{name}")


def unknown_targets(shape: ModelShape, targets: str | list[str]) -> list[str]:
    """The names in target_modules that are no linear layer of the model's decoder layers
    (none for 'all-linear'); every name when the architecture is unknown."""
    if targets == ALL_LINEAR:
        return []
    layout = DECODER_LINEARS.get(shape.model_type, ())
    return [t for t in targets if not any(_matches(t, p, n) for p, n in layout)]


def adapted_layers(shape: ModelShape, targets: str | list[str]) -> tuple[str, ...]:
    """The linear layers of each decoder layer that get an adapter, in the layer's order:
    all of them for 'all-linear', else those a name of target_modules matches (names
    matching none add nothing: lint refuses them). Architectures the plan does not know
    are counted by the common layout."""
    layout = DECODER_LINEARS.get(shape.model_type, _LLAMA_LAYOUT)
    if targets == ALL_LINEAR:
        return tuple(name for _, name in layout)
    return tuple(n for p, n in layout if any(_matches(t, p, n) for t in targets))


def adapter_params(shape: ModelShape, lora: LoraSettings) -> int:
    """Parameters of the adapters peft adds to the model: r * (in + out) for every adapted
    linear layer of every decoder layer, L * r * sum(in + out). 'all-linear' on the
    Llama/Qwen2 layout: L * r * (7H + 2q + 2kv + 3I)."""
    dims = linear_dims(shape)
    per_layer = sum(sum(dims[name]) for name in adapted_layers(shape, lora.target_modules))
    return shape.layers * lora.rank * per_layer


def adapter_bytes(shape: ModelShape, lora: LoraSettings) -> int:
    """The adapters' bytes in their own dtype (float32): what a push and an exported
    adapter carry."""
    return adapter_params(shape, lora) * DTYPE_BYTES[ADAPTER_DTYPE]


def adapter_activation_bytes_per_token(
    shape: ModelShape, lora: LoraSettings, *, dtype: str, copies_input: bool
) -> int:
    """What the adapters of one decoder layer save for backward per token, on top of the
    layer's own (memory.layer_activation_bytes_per_token): for each adapted layer A's output
    (r elements, B's input), and the input A reads when it is a tensor of its own: a copy in
    the adapter's compute dtype (copies_input: float32 adapters under autocast or over a
    base of another dtype) or, with dropout, the dropped input and its mask (1 byte an
    element). dtype: the dtype the adapters compute in. sum(r*b + in*b [+ in]) over the
    adapted layers; without a copy or dropout r*b each."""
    b = DTYPE_BYTES[dtype]
    dims = linear_dims(shape)
    dropout = lora.dropout > 0
    total = 0
    for name in adapted_layers(shape, lora.target_modules):
        fan_in = dims[name][0]
        total += lora.rank * b
        if copies_input or dropout:
            total += fan_in * b
        if dropout:
            total += fan_in
    return total


# --------------------------------------------------------------------------- vLLM


def vllm_lora_rank(rank: int) -> int | None:
    """vLLM's max_lora_rank for an adapter of this rank: the smallest valid slot >= rank
    (more would only cost memory), None above the largest (vLLM cannot serve it)."""
    return next((slot for slot in VLLM_LORA_RANKS if slot >= rank), None)


def vllm_max_loras(rollout: RolloutSettings) -> int:
    """Adapters an engine serves at once: every version a rollout may still come from, the
    policy's and the max_staleness older ones."""
    return rollout.max_staleness + 1


def _per_gpu_dims(shape: ModelShape, tensor_parallel: int) -> tuple[int, int, int, int]:
    """(H, q, kv, I) as one GPU of a tensor-parallel engine holds them: q, kv heads and I
    split over the GPUs (kv heads replicated when fewer than the GPUs)."""
    tp = tensor_parallel
    q = max(shape.heads // tp, 1) * shape.head_dim
    kv = max(shape.kv_heads // tp, 1) * shape.head_dim
    return shape.hidden, q, kv, -(-shape.intermediate // tp)


def engine_lora_slot_bytes(
    shape: ModelShape, *, rank_slot: int, max_loras: int, dtype: str, tensor_parallel: int = 1
) -> int:
    """vLLM's LoRA slots on one GPU of an engine, reserved at start-up for every linear
    layer of the decoder (whatever the adapter targets): max_loras adapters at rank s in the
    engine's dtype. Column-parallel q, k, v, gate, up keep A whole and split B's rows;
    row-parallel o and down split A's columns and keep B whole:
    max_loras * s * L * (7H + 2q/tp + 2kv/tp + 3I/tp) * b (at tp 1, the all-linear adapter
    at rank s)."""
    h, q, kv, i = _per_gpu_dims(shape, tensor_parallel)
    per_layer = 7 * h + 2 * q + 2 * kv + 3 * i
    return max_loras * rank_slot * shape.layers * per_layer * DTYPE_BYTES[dtype]


def engine_lora_scratch_bytes(
    shape: ModelShape, *, rank_slot: int, dtype: str, gpu: bool, tensor_parallel: int = 1
) -> int:
    """What vLLM's LoRA kernels hold during one forward of T tokens (its largest batch),
    besides the slots, on one GPU (or CPU worker) of an engine.

    GPU (Triton kernels): the float32 buffer between the shrink and expand of the widest
    packed layer (q, k, v: 3 slices of s) and the token-to-adapter maps, 4 int64 and 4 int32
    a token: T * (12s + 48). CPU (torch ops): each token's adapter gathered and cast to
    float32, then the product, for the widest layer side D = max(H, q/tp, I/tp):
    T * D * (s*(4 [+ b when the engine's dtype is not float32]) + 4)."""
    if gpu:
        return VLLM_GPU_BATCHED_TOKENS * (12 * rank_slot + 48)
    tokens = VLLM_CPU_BATCHED_TOKENS * tensor_parallel
    h, q, _, i = _per_gpu_dims(shape, tensor_parallel)
    widest = max(h, q, i)
    b = DTYPE_BYTES[dtype]
    gathered = 4 + (b if dtype != "float32" else 0)
    return tokens * widest * (rank_slot * gathered + 4)
