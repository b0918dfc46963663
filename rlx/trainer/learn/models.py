"""The trainer's torch modules: policy, reference, critic (a causal LM's body plus a value
head), and the optimiser and learning-rate schedule that go with each trained one."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlx.plan.memory import chunk_tokens_for_vocab
from rlx.recipe.model import ModelSettings, OptimSettings
from rlx.trainer.cpu_linear import linear, use_onednn
from rlx.trainer.learn.attention import (
    SEGMENT_ATTENTION,
    attends_by_segments,
    attends_in_full,
    layout_inputs,
)
from rlx.trainer.packing import Layout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlx.trainer.batch import SequenceBatch
    from rlx.trainer.learn.sharding import ShardSpec
    from rlx.trainer.packing import PackedRows


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

    from rlx.trainer.learn import lora

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

    from rlx.trainer.learn import lora

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


@dataclass(frozen=True)
class TokenScores:
    """Per response token, (B, R) each, zero on padding: log-prob of the token at the
    sampling temperature, and the entropy of that distribution (with a graph only when
    asked for)."""

    logprobs: Tensor
    entropy: Tensor


class ResponseScorer(nn.Module):
    """A causal LM as a function of a SequenceBatch's tensors: the log-prob of each response
    token and the entropy of the distribution it was drawn from, at temperature T.

    Memory: only the hidden states of real response tokens reach the LM head, in chunks of
    `chunk_tokens`; with gradients on, each chunk is recomputed in the backward
    (torch.utils.checkpoint), so one chunk's (tokens x vocab) fp32 logits live at a time.

    Rows that hold the same prompt (GRPO's n samples per prompt) run it once: the distinct
    prompts go through the body first, each row gets its prompt's keys and values, and only
    the responses run on top. Gradients flow back through the shared keys and values, so the
    result is a full forward's up to float rounding. Everything runs as one forward of the LM
    (sharding.run_as_forward): one DDP forward when DDP wraps this module, one FSDP2 forward
    of the sharded root. `agree` (all ranks' AND) makes every rank take the same path, which
    FSDP's collective forwards need.
    """

    def __init__(
        self,
        lm: nn.Module,
        *,
        chunk_tokens: int | None = None,
        agree: Callable[[bool], bool] | None = None,
        adapter_off: bool = False,
    ):
        super().__init__()
        config = lm.config  # type: ignore[union-attr]
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError(
                f"{type(lm).__name__} caps its logits (final_logit_softcapping), which the "
                "chunked log-probs do not apply; this trainer does not support it yet"
            )
        self.lm = lm
        vocab = config.vocab_size
        # About LOGITS_CHUNK_BYTES of fp32 logits at once, whatever the micro-batch holds.
        self.chunk_tokens = chunk_tokens or chunk_tokens_for_vocab(vocab)
        self.agree = agree
        # A LoRA policy scoring as its own reference: the base, with its adapters switched off.
        self.adapter_off = adapter_off

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor,
        prompt_width: int,
        response_mask: Tensor,
        temperature: float,
        entropy_grad: bool,
        score_index: Tensor | None = None,
        target_index: Tensor | None = None,
        layout: Layout = (),
    ) -> tuple[Tensor, Tensor]:
        """Padded rows (B, P + R), or with score_index and target_index packed rows (k, T)
        whose attention_mask is None or PackedRows.attention and whose layout is
        PackedRows.layout (rlx.trainer.packing)."""
        from rlx.trainer.learn.sharding import run_as_forward

        adapters = self.lm.disable_adapter() if self.adapter_off else contextlib.nullcontext()
        with adapters:  # type: ignore[attr-defined]
            if score_index is not None:
                return run_as_forward(
                    self.lm,
                    self._score_packed,
                    input_ids,
                    position_ids,
                    score_index,
                    target_index,
                    response_mask,
                    temperature,
                    entropy_grad,
                    attention_mask,
                    layout,
                )
            assert attention_mask is not None, "padded rows need their attention mask"
            return run_as_forward(
                self.lm,
                self._score,
                input_ids,
                attention_mask,
                position_ids,
                prompt_width,
                response_mask,
                temperature,
                entropy_grad,
            )

    def _can_share(self, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Any:
        width = input_ids.shape[1] - prompt_width  # R
        groups = None
        if prompt_width > 0 and width > 1 and can_share_prompts(self.lm):
            groups = prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
        if self.agree is not None and not self.agree(groups is not None):
            return None
        return groups

    def response_hidden(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_width: int
    ) -> Tensor:
        """(B, R, H) final hidden states at the positions that predict each response token.
        Call inside the LM's forward (see forward)."""
        body = self.lm.get_decoder()  # type: ignore[operator]
        width = input_ids.shape[1] - prompt_width  # R
        groups = self._can_share(input_ids, attention_mask, prompt_width)
        if groups is None:
            hidden = body(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state  # (B, P + R, H)
            # position P - 1 + t predicts response token t
            return hidden[:, prompt_width - 1 : prompt_width - 1 + width]  # (B, R, H)
        cache, head = shared_prompt_cache(
            body, groups, input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        )  # head (B, 1, H) predicts response token 0
        tail = body(
            input_ids=input_ids[:, prompt_width:-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, prompt_width:-1],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # (B, R - 1, H) predict response tokens 1..R-1
        return torch.cat([head, tail], dim=1)  # (B, R, H)

    def _score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_width: int,
        response_mask: Tensor,
        temperature: float,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        hidden = self.response_hidden(input_ids, attention_mask, position_ids, prompt_width)
        targets = input_ids[:, prompt_width:]  # (B, R)
        real_hidden = hidden[response_mask]  # (N, H): padding never reaches the head
        real_targets = targets[response_mask]  # (N,)
        return self._head_scores(
            real_hidden, real_targets, response_mask, temperature, entropy_grad
        )

    def _score_packed(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        score_index: Tensor,
        target_index: Tensor | None,
        response_mask: Tensor,
        temperature: float,
        entropy_grad: bool,
        attention: Tensor | None,
        layout: Layout,
    ) -> tuple[Tensor, Tensor]:
        body = self.lm.get_decoder()  # type: ignore[operator]
        # No 2-D attention mask and no cache: the only calls that keep packed sequences apart
        # (packed_attention says which).
        hidden = body(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            **packed_attention(body, attention, layout, input_ids.device),
        ).last_hidden_state  # (k, T, H)
        real_hidden = hidden.flatten(0, 1)[score_index]  # (N, H)
        if target_index is None:
            target_index = score_index + 1  # every sequence's own tokens follow each other
        real_targets = input_ids.flatten()[target_index]  # (N,): the token each predicts
        return self._head_scores(
            real_hidden, real_targets, response_mask, temperature, entropy_grad
        )

    def _head_scores(
        self,
        real_hidden: Tensor,
        real_targets: Tensor,
        response_mask: Tensor,
        temperature: float,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        """(N, H) hidden states of the scored tokens and their (N,) targets -> (B, R) log-probs
        and entropies, zero where response_mask is False."""
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        logprobs, entropy = chunked_token_scores(
            real_hidden,
            head.weight,
            getattr(head, "bias", None),
            real_targets,
            temperature=temperature,
            entropy_grad=entropy_grad,
            chunk_tokens=self.chunk_tokens,
        )  # (N,) each
        zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=real_hidden.device)
        return zeros.masked_scatter(response_mask, logprobs), zeros.masked_scatter(
            response_mask, entropy
        )  # (B, R) each


def _chunk_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of one chunk of tokens: hidden (n, H), targets (n,) -> (n,)."""
    logits = linear(hidden, weight, bias).float()  # (n, V): as the model's own linears run
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # (n,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = logsumexp(z) - sum_v p_v z_v
        entropy = logz - torch.einsum("nv,nv->n", torch.softmax(logits, dim=-1), logits)
    return logprobs, entropy


def chunked_token_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float,
    entropy_grad: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and entropies under softmax((hidden @ weight.T + bias) / T),
    chunk by chunk of tokens: hidden (N, H), targets (N,) -> (N,), (N,) fp32. With gradients
    on, each chunk's logits are recomputed in the backward instead of kept."""
    from torch.utils.checkpoint import checkpoint

    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        piece = (
            hidden[start : start + chunk_tokens],
            weight,
            bias,
            targets[start : start + chunk_tokens],
            temperature,
            entropy_grad,
        )
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_scores, *piece, use_reentrant=False)
        else:
            lp, ent = _chunk_scores(*piece)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def score_responses(
    scorer: nn.Module,
    batch: SequenceBatch,
    temperature: float,
    *,
    entropy_grad: bool,
    packed: PackedRows | None = None,
) -> TokenScores:
    """(B, R) log-probs and entropies of a batch's responses, from a ResponseScorer (or DDP of
    one); with `packed`, the same sequences run packed (no padding)."""
    if packed is not None:
        logprobs, entropy = scorer(
            packed.input_ids,
            packed.attention,
            packed.position_ids,
            0,
            batch.response_mask,
            temperature,
            entropy_grad,
            packed.score_index,
            packed.target_positions(),
            packed.layout,
        )
        return TokenScores(logprobs, entropy)
    logprobs, entropy = scorer(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.prompt_width,
        batch.response_mask,
        temperature,
        entropy_grad,
    )
    return TokenScores(logprobs, entropy)


def response_values(
    critic: nn.Module, batch: SequenceBatch, packed: PackedRows | None = None
) -> Tensor:
    """V(state before response token t) for every t: (B, R); with `packed`, the same
    sequences run packed (zero off the response mask)."""
    if packed is not None:
        values = critic(
            packed.input_ids, packed.attention, packed.position_ids, packed.layout
        )  # (k, T)
        scored = values.flatten()[packed.score_index]  # (N,)
        zeros = torch.zeros(batch.response_mask.shape, dtype=scored.dtype, device=scored.device)
        return zeros.masked_scatter(batch.response_mask, scored)  # (B, R)
    values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)  # (B, P + R)
    return values[:, batch.prompt_width - 1 : -1]  # (B, R)


# Attention implementations that take a 4-D mask as it is: True/False (SDPA) or 0/-inf
# added to the scores (eager). Rows whose sequences share a prompt need one.
MASKED_ATTENTION = ("sdpa", "eager")


def attention_for(model: nn.Module, attention: Tensor | None) -> Tensor | None:
    """PackedRows.attention ((k, 1, T, T), True where a position attends) in the form the
    model's attention implementation takes; None stays None (the position ids say it all)."""
    if attention is None:
        return None
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation == "sdpa":
        return attention
    if implementation != "eager":
        raise ValueError(f"rows sharing prompts need SDPA or eager attention, not {implementation}")
    dtype = model.get_input_embeddings().weight.dtype  # type: ignore[operator]
    scores = torch.zeros(attention.shape, dtype=dtype, device=attention.device)
    return scores.masked_fill(~attention, torch.finfo(dtype).min)


def packed_attention(
    model: nn.Module, attention: Tensor | None, layout: Layout, device: torch.device
) -> dict[str, Any]:
    """The attention keywords of a packed forward of `model` (a decoder body): its layout
    where it attends by segments (rlx.trainer.learn.attention); else the 4-D mask of rows
    that share prompts in the form its attention takes, or None, from which transformers
    derives the block-diagonal mask (restarting position ids)."""
    if attends_by_segments(model):
        return layout_inputs(layout, device)
    if attention is None and any(len(s[2]) > 1 for row in layout for s in row):
        raise ValueError("rows that share prompts need their 4-D mask for this model")
    return {"attention_mask": attention_for(model, attention)}


def shares_packed_prompts(model: nn.Module) -> bool:
    """Whether packed rows may run a prompt once for several responses (a layout or a 4-D
    mask of prompt-and-own-response): the model attends by segments, or its attention
    takes such a mask as it is, and every layer attends in full (a sliding window would
    need its own)."""
    inner = getattr(model, "body", model)
    config = getattr(inner, "config", None)
    if config is None or packing_obstacle(model) is not None:
        return False
    return attends_in_full(config) and (
        getattr(config, "_attn_implementation", None) or "eager"
    ) in (*MASKED_ATTENTION, SEGMENT_ATTENTION)


# Attention implementations of transformers that keep packed sequences apart when called with
# restarting position ids, no attention mask and no cache (see rlx.trainer.packing), and
# segment attention, which reads their layout.
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", SEGMENT_ATTENTION)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def packing_obstacle(model: nn.Module) -> str | None:
    """Why `model` cannot run packed sequences exactly, or None when it can: a recurrent
    ("stateful") model or one with linear-attention layers carries state across the
    sequences of a row, and an attention implementation other than SDPA, eager or
    FlashAttention may ignore the restarting position ids."""
    inner = getattr(model, "body", model)  # a ValueModel's decoder
    config = getattr(inner, "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    name = type(inner).__name__
    if getattr(inner, "_is_stateful", False):
        return f"{name} is recurrent (its state runs across the sequences of a row)"
    kinds = set(getattr(config, "layer_types", None) or ())
    others = kinds - {"full_attention", "sliding_attention"}
    if others:
        return f"{name} has {sorted(others)[0]} layers, which packing would mix"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in PACKABLE_ATTENTION:
        return f"{name} runs {attention} attention; packing is exact with " + ", ".join(
            PACKABLE_ATTENTION
        )
    return None


def uses_varlen_attention(model: nn.Module) -> bool:
    """FlashAttention's varlen kernels: packed rows cost nothing for a mask, so a pass is one
    row (transformers reads sequence starts from the position ids of a single row only)."""
    inner = getattr(model, "body", model)
    attention = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    return attention in VARLEN_ATTENTION


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
