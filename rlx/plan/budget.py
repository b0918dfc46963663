"""The budgets of the memory plan: what one training GPU, one rollout GPU and one node's host
memory hold, item by item, as the trainer builds them; and how the actors pack onto the nodes.

planner.py puts them together into a plan and its verdict; strategy.py plans the replicated
(DDP) training GPU to choose a strategy.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlx.plan import lora as lora_sizes
from rlx.plan import memory as mem
from rlx.plan.shapes import ModelShape, PlanError
from rlx.recipe.model import (
    LoraSettings,
    NodeGroup,
    ParallelSettings,
    Recipe,
    Resources,
    TrainerSettings,
    episode_token_budget,
    fixed_int,
)
from rlx.storage import is_store_url
from rlx.trainer.rollout import choose_engine, engine_dtype_name

GIB = mem.GIB
MICRO_BATCH_FIELD = "trainer.batch.micro_batch_size"
HEADROOM = 0.10  # a plan with less spare memory than this is a warning
RUNTIME_GIB = 2.0  # per GPU process: CUDA context, NCCL buffers, allocator slack
VLLM_RESERVE_GIB = 2.0  # inside vLLM's budget: its activation peak and CUDA graphs
# What a sleeping colocated vLLM engine still holds on its GPU: sleep frees only its weights'
# and KV cache's memory pools, not the CUDA graphs' pool, its persistent input and sampler
# buffers, the kernels and library workspaces its start-up loaded into the process's CUDA
# context, or the allocator's cached blocks. An estimate, not a measurement: NeMo RL saw
# about 0.75 GiB for a sleeping 1B engine at tensor parallel 1, context included.
VLLM_ASLEEP_GIB = 1.0
# s3fs uploads a file in parts of 50 MiB, up to 10 at once (its max_concurrency): the host
# memory one rank's upload holds at its peak. gcsfs and adlfs hold less.
UPLOAD_BUFFER_BYTES = 10 * 50 * 2**20
HOST_PROCESS_GIB = 2.0  # per Ray actor or the controller: Python, torch, transformers
# Per split vLLM engine (its actor and engine core). A colocated engine runs inside the
# training process, so it adds no process of its own.
HOST_ENGINE_GIB = 4.0


@dataclass(frozen=True)
class Item:
    """One line of the plan. phase: when it is held, "all" (resident), "update" or
    "rollout"; "" for a line that is only detail (a part of another, or unused)."""

    name: str
    bytes: int
    note: str = ""
    phase: str = "all"


@dataclass
class Budget:
    """One kind of GPU (training or rollout) or one node's host memory."""

    title: str
    count: int  # how many GPUs (or nodes) look like this
    capacity: int | None  # bytes; None: not given (host memory unset)
    items: list[Item] = field(default_factory=list)
    peak: int = 0
    peak_phase: str = ""
    engine_sequences: int | None = None  # full-length sequences its vLLM KV cache holds
    # a training rank's AdamW moments in pinned host memory while its colocated vLLM
    # engine generates (Learner.move_optimizer_state moves them with non_blocking copies)
    pinned_host: int = 0

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def in_peak(self, item: Item) -> bool:
        return item.phase in ("all", self.peak_phase)

    @property
    def headroom(self) -> float | None:
        if not self.capacity:
            return None
        return 1.0 - self.peak / self.capacity


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


@dataclass(frozen=True)
class TrainedModel:
    """A model the training ranks train, as the plan counts it: with LoRA its base is frozen
    in the compute dtype and only the float32 adapters (and a critic's value head) train."""

    label: str  # "policy" or "critic"
    shape: ModelShape
    params: int  # all of it: the LM, or the critic's body and value head
    lora: LoraSettings | None

    @property
    def head(self) -> int:
        """The critic's value head (H + 1), which trains whole."""
        return self.shape.hidden + 1 if self.label == "critic" else 0

    @property
    def adapters(self) -> int:
        return 0 if self.lora is None else lora_sizes.adapter_params(self.shape, self.lora)

    @property
    def trained(self) -> int:
        return self.params if self.lora is None else self.adapters + self.head

    @property
    def frozen(self) -> int:
        return 0 if self.lora is None else self.params - self.head

    def trained_dtype(self, master: str) -> str:
        return master if self.lora is None else lora_sizes.ADAPTER_DTYPE


def trained_models(
    trainer: TrainerSettings, shape: ModelShape, critic_shape: ModelShape | None
) -> list[TrainedModel]:
    """The policy and, for PPO, the critic, each with the LoRA settings the trainer builds
    it with (a critic without critic_model is the policy's model, its lora included)."""
    models = [TrainedModel("policy", shape, shape.params, trainer.model.lora)]
    if critic_shape is not None:
        critic = trainer.critic_model or trainer.model
        models.append(TrainedModel("critic", critic_shape, critic_shape.critic_params, critic.lora))
    return models


def checkpoint_size(models: list[TrainedModel], master: str) -> int:
    """One checkpoint: what trains, weights and AdamW moments (with LoRA the adapters and a
    critic's value head in float32; the frozen base is named, not saved)."""
    return sum(
        mem.checkpoint_bytes(m.trained, 0, param_dtype=m.trained_dtype(master)) for m in models
    )


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Layout:
    """How many of each actor, and what the busiest nodes hold."""

    train_ranks: int
    engines: int  # split rollout engines
    tp: int
    # (training ranks, split engines) per distinct kind of node, with how many such nodes
    node_kinds: tuple[tuple[int, int, int], ...]

    @property
    def train_nodes(self) -> int:
        """How many nodes the training ranks span."""
        return sum(count for ranks, _, count in self.node_kinds if ranks)


def layout_of(recipe: Recipe) -> Layout:
    """The trainer's placement (rlx.plan.actors.plan_actors) and a packing of it onto
    the nodes: training ranks fill nodes first, engines take tp GPUs of one node each."""
    from rlx.plan.actors import plan_actors

    trainer = recipe.trainer
    assert trainer is not None
    actors = plan_actors(recipe)
    tp = trainer.rollout.tensor_parallel_size
    rollout = recipe.resources.rollout_nodes
    if rollout is not None:
        # resources.groups: ranks fill the train nodes, engines the rollout nodes
        train = recipe.resources.train_nodes
        per_train = -(-actors.train_workers // train.nodes)
        per_rollout = -(-actors.rollout_workers // rollout.nodes)
        kinds = ((per_train, 0, train.nodes), (0, per_rollout, rollout.nodes))
        return Layout(actors.train_workers, actors.rollout_workers, tp or 1, kinds)
    gpn, nodes = recipe.resources.gpus_per_node, recipe.resources.nodes
    if gpn == 0:
        return Layout(actors.train_workers, actors.rollout_workers, 1, ((1, 0, nodes),))
    free = [gpn] * nodes
    ranks = [0] * nodes
    engines = [0] * nodes
    left = actors.train_workers
    for i in range(nodes):
        take = min(left, free[i])
        ranks[i], free[i], left = take, free[i] - take, left - take
    for _ in range(actors.rollout_workers):
        for i in range(nodes):
            if free[i] >= tp:
                engines[i], free[i] = engines[i] + 1, free[i] - tp
                break
    kinds: dict[tuple[int, int], int] = {}
    for r, e in zip(ranks, engines, strict=True):
        kinds[(r, e)] = kinds.get((r, e), 0) + 1
    return Layout(
        actors.train_workers,
        actors.rollout_workers,
        tp,
        tuple((r, e, n) for (r, e), n in sorted(kinds.items(), reverse=True)),
    )


# --------------------------------------------------------------------------- the plan


def dtypes(trainer: TrainerSettings, gpu: bool, strategy: str) -> tuple[str, str, str]:
    """(compute, master parameter, residual stream) dtypes as the trainer uses them."""
    compute = trainer.model.dtype
    if compute == "auto":
        compute = "bfloat16" if gpu else "float32"
    if not gpu:
        return compute, compute, compute
    # float32 master weights; FSDP's MixedPrecisionPolicy runs the modules in the compute
    # dtype, while a whole fp32 module under autocast keeps an fp32 residual stream.
    residual = compute if strategy == "fsdp" else "float32"
    return compute, "float32", residual


def sequence_tokens(trainer: TrainerSettings) -> int:
    """The longest sequence a rollout holds: a prompt and its response, or with an
    environment its longest episode (every turn and observation after the prompt)."""
    return trainer.data.max_prompt_length + episode_token_budget(trainer)


# What the controller holds per rollout token: its id (int64), the engine's log-prob and the
# learner's (float32 each) and its mask.
ROLLOUT_TOKEN_BYTES = 8 + 4 + 4 + 1


@dataclass(frozen=True)
class Generation:
    """A step's generation: prompts x n samples per generate call, and how many calls at
    most (dynamic sampling's rounds; one without it)."""

    prompts: int
    n: int
    tokens: int  # the longest sequence a sample holds
    rounds: int
    dtype: str  # the engines'

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    def held_bytes(self) -> int:
        """The rollouts of every round the controller holds until it picks the step's groups."""
        return self.rounds * self.samples * self.tokens * ROLLOUT_TOKEN_BYTES


def generation_of(trainer: TrainerSettings, gpu: bool) -> Generation:
    filtering = trainer.batch.filter_groups
    return Generation(
        prompts=trainer.batch.prompts_per_step,
        n=trainer.rollout.n,
        tokens=sequence_tokens(trainer),
        rounds=1 if filtering is None else filtering.max_rounds,
        dtype=engine_dtype_name(trainer, gpu),
    )


def packed_pass_tokens(trainer: TrainerSettings) -> int:
    """The most tokens a packed pass holds: max_tokens_per_micro_batch, or micro_batch_size
    sequences of the longest length, so that a packed pass needs no more memory than the
    padded micro-batch it replaces (micro_batch_tokens sizes both alike)."""
    batch = trainer.batch
    if batch.max_tokens_per_micro_batch is not None:
        return batch.max_tokens_per_micro_batch
    return fixed_int(batch.micro_batch_size, MICRO_BATCH_FIELD) * sequence_tokens(trainer)


def micro_batch_tokens(trainer: TrainerSettings, ranks: int) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch: max_tokens_per_micro_batch, or
    min(micro_batch_size, a rank's share of a minibatch) sequences of prompt + response (with
    an environment, the longest episode: every turn and observation after the prompt). A
    packed pass (packed_pass_tokens) holds at most as many: its sequences are the same ones,
    without the padding."""
    batch = trainer.batch
    prompt, response = trainer.data.max_prompt_length, episode_token_budget(trainer)
    if batch.max_tokens_per_micro_batch is not None:
        budget = max(batch.max_tokens_per_micro_batch, prompt + response)
        return budget, budget  # responses may fill the budget: the logits' worst case
    samples = batch.prompts_per_step * trainer.rollout.n
    share = max((batch.minibatch_size or samples) // max(ranks, 1), 1)
    rows = min(fixed_int(batch.micro_batch_size, MICRO_BATCH_FIELD), share)
    return rows * (prompt + response), rows * response


def gpu_capacity(group: NodeGroup, env: Mapping[str, str] | None = None) -> int | None:
    """Bytes of one of the group's GPUs (None for CPU-only nodes); PlanError when its type
    is not in the table (nor in RLX_ACCELERATOR_GIB)."""
    if not group.gpus_per_node:
        return None
    name = group.accelerator_type or ""
    size = mem.accelerator_gib(name, env)
    if size is None:
        raise UnknownAccelerator(unknown_accelerator(name))
    return int(size * GIB)


class UnknownAccelerator(PlanError):
    """An accelerator the plan's table (and RLX_ACCELERATOR_GIB) has no memory size for."""


def unknown_accelerator(name: str) -> str:
    """What to do about an accelerator the plan's table lacks: the table's nearest names
    first (a typo), then all of them, then how to size other hardware."""
    by_upper = {known.upper(): known for known in mem.ACCELERATOR_GIB}
    close = difflib.get_close_matches(name.upper(), by_upper, n=3)
    family = name.upper().split("-")[0]
    if family in by_upper:  # a known GPU with a suffix of its own (H100-80GB): its kin only
        close = [family] + [c for c in close if c != family and c.split("-")[0] == family]
    close = [by_upper[c] for c in close]
    guess = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"accelerator {name!r} has no memory size in the plan's table, so no plan can vouch "
        f"for it; {guess}use the table's name ({', '.join(mem.ACCELERATOR_GIB)}), or for other "
        f"hardware give its memory: {mem.ACCELERATOR_GIB_ENV}='{name}=GIB' in the environment"
    )


def training_budget(
    trainer: TrainerSettings,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    layout: Layout,
    strategy: str,
    gpu: bool,
    capacity: int | None,
) -> Budget:
    """One training GPU (or a CPU rank's host memory): the models' resident state, the
    update's peak on top of it and, with a colocated vLLM engine, the rollout's. Each
    phase's peak is the sum of the items held in it."""
    ranks = layout.train_ranks
    title = f"training GPU (x{ranks})" if gpu else "training rank (host)"
    budget = Budget(title, ranks, capacity)
    colocated = colocated_vllm(trainer, gpu)
    _state_items(budget, trainer, shape, critic_shape, ranks, strategy, gpu, colocated)
    _update_items(budget, trainer, shape, critic_shape, ranks, strategy, gpu)
    if colocated:
        _colocated_engine_items(budget, trainer, shape, capacity or 0)
    elif not gpu and trainer.layout == "colocated" and engine_of(trainer, gpu) == "vllm":
        # vLLM on CPU in the training process: its LoRA slots stay, its scratch comes and goes
        dtype = engine_dtype_name(trainer, gpu)
        tp = trainer.rollout.tensor_parallel_size
        for item in engine_lora_items(trainer, shape, dtype=dtype, tensor_parallel=tp, gpu=False):
            phase = "all" if item.name.endswith("slots") else "rollout"
            budget.items.append(Item(f"{item.name} (CPU)", tp * item.bytes, item.note, phase))
    for phase in ("update", "rollout"):
        held = sum(i.bytes for i in budget.items if i.phase in ("all", phase))
        if phase == "update" or held > budget.peak:
            budget.peak, budget.peak_phase = held, phase
    return budget


def _state_items(
    budget: Budget,
    trainer: TrainerSettings,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    ranks: int,
    strategy: str,
    gpu: bool,
    colocated: bool,
) -> None:
    """What a rank holds between steps: the trained models' weights, gradients and AdamW
    moments, the reference, and the GPU runtime. With a colocated vLLM engine the gradients
    are freed after each step and the moments move to the host while the engine generates
    (Learner.move_optimizer_state): both are held in the update only. With LoRA a model's
    base is frozen in the compute dtype (sharded like any weight under FSDP, on the host
    with its offload), its adapters train in float32, and the reference is the policy's
    base with the adapters off: no copy."""
    parallel = trainer.parallel
    compute, master, _ = dtypes(trainer, gpu, strategy)
    offload = parallel.offload_optimizer and strategy == "fsdp"
    # moved off the GPU for generation; FSDP's offload keeps them on the host already
    away = colocated and not offload
    held = _RankState(budget, ranks, strategy, offload, away, compute, master)
    policy, *critic = trained_models(trainer, shape, critic_shape)
    held.add_model(policy)
    if trainer.algo.kl.coef > 0 and policy.lora is None:
        ref = mem.reference_bytes(shape, ranks=ranks, strategy=strategy, dtype=compute)
        ref_on_host = parallel.offload_reference and strategy == "fsdp"
        budget.items.append(
            Item(
                "reference",
                ref,
                compute + held.sharded + (", in host memory" if ref_on_host else ""),
                "" if ref_on_host else "all",
            )
        )
    for model in critic:
        held.add_model(model)
    if gpu:
        budget.items.append(Item("runtime (CUDA, NCCL, allocator)", int(RUNTIME_GIB * GIB)))


@dataclass(frozen=True)
class _RankState:
    """How a rank holds a trained model's state, into `budget`: sharded under FSDP, on the
    host with its optimizer offload, gradients and moments held in the update only when
    `away` (a colocated vLLM engine generates between the updates)."""

    budget: Budget
    ranks: int
    strategy: str
    offload: bool
    away: bool
    compute: str
    master: str

    @property
    def sharded(self) -> str:
        return ", sharded" if self.strategy == "fsdp" else ""

    @property
    def on_host(self) -> str:
        return ", in host memory" if self.offload else ""

    def add_model(self, model: TrainedModel) -> None:
        """A model's weights, gradients and moments: with LoRA its frozen base, then its
        adapters' (and value head's) state."""
        if model.lora is None:
            self.add_state(model.label, model.shape, model.params, self.master)
            return
        base = mem.frozen_bytes(
            model.frozen, ranks=self.ranks, strategy=self.strategy, dtype=self.compute
        )
        self.budget.items.append(
            Item(
                f"{model.label} base (frozen)",
                base,
                f"{self.compute}{self.sharded}{self.on_host}",
                "" if self.offload else "all",
            )
        )
        head = " and value head" if model.head else ""
        label = f"{model.label} LoRA{head}"
        self.add_state(label, model.shape, model.trained, model.trained_dtype(self.master))

    def add_state(self, label: str, s: ModelShape, params: int, dtype: str) -> None:
        items = self.budget.items
        st = mem.training_state_bytes(
            s,
            ranks=self.ranks,
            strategy=self.strategy,
            offload_optimizer=self.offload,
            param_dtype=dtype,
            params=params,
        )
        note = f"{dtype}{self.sharded}{self.on_host}"
        phase = "" if self.offload else "all"
        items.append(Item(f"{label} weights", st["weights"], note, phase))
        if self.away:
            items.append(
                Item(f"{label} grads", st["grads"], f"{note}, freed after each step", "update")
            )
            items.append(
                Item(
                    f"{label} optimizer (AdamW)",
                    st["optimizer"],
                    f"{note}, on the host while vLLM generates",
                    "update",
                )
            )
            self.budget.pinned_host += st["optimizer"]
        else:
            items.append(Item(f"{label} grads", st["grads"], note, phase))
            items.append(Item(f"{label} optimizer (AdamW)", st["optimizer"], note, phase))
        if st["ddp_buckets"]:
            items.append(Item(f"{label} DDP gradient buckets", st["ddp_buckets"], "ddp"))


def adapter_compute(compute: str, gpu: bool, strategy: str) -> tuple[str, bool]:
    """(the dtype LoRA's float32 adapters compute in, whether each adapted layer saves a copy
    of its input in it). FSDP's mixed precision gathers them in the compute dtype, so they
    read the base's input as it is; autocast (one rank, DDP) runs them in the compute dtype
    on a copy of the input peft casts to float32 first; CPU runs have no autocast, so a base
    in another dtype than float32 hands them a float32 copy."""
    if gpu and strategy == "fsdp":
        return compute, False
    if gpu and compute != "float32":
        return compute, True
    return lora_sizes.ADAPTER_DTYPE, compute != lora_sizes.ADAPTER_DTYPE


def _update_items(
    budget: Budget,
    trainer: TrainerSettings,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    ranks: int,
    strategy: str,
    gpu: bool,
) -> None:
    """What one micro-batch's forward and backward add: activations (with or without
    checkpointing; LoRA's adapters add their own, and a base stored in the compute dtype
    keeps the residual stream in it), the LM head's chunked logits, FSDP's gathered layers
    and the root's unsharded gradients (none of a frozen root)."""
    compute, _, _ = dtypes(trainer, gpu, strategy)
    items = budget.items
    tokens, response_tokens = micro_batch_tokens(trainer, ranks)
    models = trained_models(trainer, shape, critic_shape)
    activations, used = _activation_items(trainer, models, critic_shape, tokens, gpu, strategy)
    items += activations
    items += _autocast_items(models, compute, used, ranks, strategy, gpu)
    chunk = mem.logits_chunk_tokens(shape)
    logits = mem.logits_peak_bytes(shape, response_tokens, dtype=compute, chunk_tokens=chunk)
    note = f"chunks of {min(chunk, response_tokens)} of {response_tokens} response tokens"
    items.append(Item("logits peak", logits, note, "update"))
    items += _fsdp_update_items(models, trainer.parallel, compute, ranks, strategy)


def _activation_items(
    trainer: TrainerSettings,
    models: list[TrainedModel],
    critic_shape: ModelShape | None,
    tokens: int,
    gpu: bool,
    strategy: str,
) -> tuple[list[Item], bool]:
    """A micro-batch's activations without and with gradient checkpointing, the one the
    recipe uses in the update's peak; (items, whether it checkpoints)."""
    compute, _, residual = dtypes(trainer, gpu, strategy)
    lora_dtype, copies_input = adapter_compute(compute, gpu, strategy)

    def activations(m: TrainedModel, checkpointing: bool) -> int:
        extra = 0
        if m.lora is not None:
            extra = lora_sizes.adapter_activation_bytes_per_token(
                m.shape, m.lora, dtype=lora_dtype, copies_input=copies_input
            )
        return mem.activation_bytes(
            m.shape,
            tokens,
            dtype=compute,
            residual_dtype=residual if m.lora is None else compute,
            checkpointing=checkpointing,
            extra_per_token=extra,
        )

    # One flag for both models' rows: either model checkpointing counts as checkpointed
    # (the shipped recipes set the critic's like the policy's).
    checkpointing = [trainer.model.gradient_checkpointing]
    if critic_shape is not None:
        checkpointing.append((trainer.critic_model or trainer.model).gradient_checkpointing)
    act = {flag: max(activations(m, flag) for m in models) for flag in (False, True)}
    used = any(checkpointing)
    items = [
        Item(
            "activations, no checkpointing",
            act[False],
            f"{tokens} tokens per micro-batch",
            "" if used else "update",
        ),
        Item(
            "activations, gradient checkpointing",
            act[True],
            f"{tokens} tokens per micro-batch",
            "update" if used else "",
        ),
    ]
    return items, used


def _autocast_items(
    models: list[TrainedModel], compute: str, used: bool, ranks: int, strategy: str, gpu: bool
) -> list[Item]:
    """The copies autocast keeps from a forward to its backward: of the float32 master
    weights (not under FSDP) and of the float32 LoRA adapters."""
    items = []
    lora_dtype, copies_input = adapter_compute(compute, gpu, strategy)
    if gpu and mem.runs_as(strategy, ranks) != "fsdp" and compute != "float32":
        # autocast casts each float32 master weight once per forward and the products keep
        # the copy for their backward: every layer's, where no checkpointing drops them
        # (measured on an H100 at Qwen2.5-1.5B's shape: docs/gpu.md)
        cast = (
            max(
                (m.shape.layers * m.shape.layer_params for m in models if m.lora is None), default=0
            )
            * mem.DTYPE_BYTES[compute]
        )
        if cast:
            note = f"{compute}, every layer's, from forward to backward"
            items.append(Item("weights, autocast's copies", cast, note, "" if used else "update"))
    if copies_input and lora_dtype != lora_sizes.ADAPTER_DTYPE:
        # autocast keeps a compute-dtype copy of every float32 adapter from the forward to
        # the backward
        cast = max(m.adapters for m in models) * mem.DTYPE_BYTES[lora_dtype]
        if cast:
            note = f"{lora_dtype}, from forward to backward"
            items.append(Item("LoRA adapters, autocast's copies", cast, note, "update"))
    return items


def _fsdp_update_items(
    models: list[TrainedModel],
    parallel: ParallelSettings,
    compute: str,
    ranks: int,
    strategy: str,
) -> list[Item]:
    """FSDP's gathered layers and the root's unsharded gradients (none of a frozen root)."""
    items = []
    gathered = max(
        mem.gathered_params_bytes(
            m.shape,
            strategy=strategy,
            ranks=ranks,
            dtype=compute,
            reshard_after_forward=parallel.reshard_after_forward,
            extra_layer_params=m.adapters // m.shape.layers,
        )
        for m in models
    )
    if gathered:
        items.append(
            Item("gathered params (FSDP)", gathered, f"{compute}, root + layers", "update")
        )
    root = max(
        mem.root_grad_bytes(
            m.shape,
            strategy=strategy,
            ranks=ranks,
            dtype=compute,
            params=m.params,
            trained_root=None if m.lora is None else m.head,
        )
        for m in models
    )
    if root:
        items.append(
            Item(
                "root grads, unsharded (FSDP)",
                root,
                f"{compute} grads + {mem.REDUCE_DTYPE} reduce-scatter input",
                "update",
            )
        )
    return items


def _colocated_engine_items(
    budget: Budget, trainer: TrainerSettings, shape: ModelShape, capacity: int
) -> None:
    """A vLLM engine in the training process: its share of the GPU while it generates, and
    what sleep mode leaves behind during the update."""
    compute = engine_dtype_name(trainer, on_gpus=True)
    util = trainer.rollout.gpu_memory_utilization
    engine = int(util * capacity)
    weights = mem.engine_weight_bytes(shape, dtype=compute)
    lora = engine_lora_items(trainer, shape, dtype=compute, tensor_parallel=1, gpu=True)
    lora = [
        Item(f"{i.name} (colocated)", i.bytes, f"{i.note}, in the budget below", "") for i in lora
    ]
    held = weights + sum(i.bytes for i in lora) + int(VLLM_RESERVE_GIB * GIB)
    kv = max(engine - held, 0)  # its budget, as split
    seq = sequence_tokens(trainer)
    budget.engine_sequences = kv // mem.kv_bytes_per_token(shape, dtype=compute) // seq
    budget.items += [
        Item("vLLM weights (colocated)", weights, "in the budget below", ""),
        *lora,
        Item("vLLM KV cache (colocated)", kv, "in the budget below", ""),
        Item("vLLM budget (colocated)", engine, f"{util} of the GPU, asleep in update", "rollout"),
        Item(
            "vLLM asleep (colocated)",
            int(VLLM_ASLEEP_GIB * GIB),
            "graphs, buffers, allocator cache sleep keeps (estimate)",
            "update",
        ),
    ]


def engine_lora_items(
    trainer: TrainerSettings, shape: ModelShape, *, dtype: str, tensor_parallel: int, gpu: bool
) -> list[Item]:
    """A vLLM engine serving the policy's LoRA adapters: its slots (max_loras adapters at
    max_lora_rank, beside its own copy of the base) and its LoRA kernels' scratch, on one of
    its GPUs (or CPU workers). None without LoRA."""
    lora = trainer.model.lora
    if lora is None:
        return []
    slot = lora_sizes.vllm_lora_rank(lora.rank) or lora.rank  # above 512: lint refuses it
    loras = lora_sizes.vllm_max_loras(trainer.rollout)
    slots = lora_sizes.engine_lora_slot_bytes(
        shape, rank_slot=slot, max_loras=loras, dtype=dtype, tensor_parallel=tensor_parallel
    )
    scratch = lora_sizes.engine_lora_scratch_bytes(
        shape, rank_slot=slot, dtype=dtype, gpu=gpu, tensor_parallel=tensor_parallel
    )
    return [
        Item(
            "vLLM LoRA slots",
            slots,
            f"max_loras {loras} x max_lora_rank {slot}, every linear layer, {dtype}",
        ),
        Item("vLLM LoRA scratch", scratch, "its LoRA kernels' buffers at the largest batch"),
    ]


def engine_of(trainer: TrainerSettings, gpu: bool) -> str:
    """The engine the trainer chooses (the count of GPUs does not change the choice)."""
    return choose_engine(trainer.rollout.engine, gpus_per_node=int(gpu))


def colocated_vllm(trainer: TrainerSettings, gpu: bool) -> bool:
    """Training GPUs that also hold a vLLM engine."""
    return gpu and trainer.layout == "colocated" and engine_of(trainer, gpu) == "vllm"


def rollout_budget(
    trainer: TrainerSettings, shape: ModelShape, layout: Layout, capacity: int
) -> Budget:
    compute = engine_dtype_name(trainer, on_gpus=True)
    tp = layout.tp
    util = trainer.rollout.gpu_memory_utilization
    budget = Budget(
        f"rollout GPU (x{layout.engines * tp}, {layout.engines} engine(s) of tp {tp})",
        layout.engines * tp,
        capacity,
    )
    weights = mem.engine_weight_bytes(shape, dtype=compute, tensor_parallel=tp)
    lora = engine_lora_items(trainer, shape, dtype=compute, tensor_parallel=tp, gpu=True)
    engine = int(util * capacity)
    reserve = int(VLLM_RESERVE_GIB * GIB)
    kv = max(engine - weights - reserve - sum(i.bytes for i in lora), 0)
    per_token = mem.kv_bytes_per_token(shape, dtype=compute, tensor_parallel=tp)
    tokens = kv // per_token
    seq = sequence_tokens(trainer)
    # vLLM sizes its KV cache so that everything it holds, CUDA context included, stays
    # within gpu_memory_utilization of the GPU: its budget is the GPU's peak.
    budget.items += [
        Item("vLLM weights", weights, f"{compute}, 1/{tp} of the model"),
        Item("vLLM activations, graphs, CUDA", reserve, "inside its budget"),
        *lora,
        Item("vLLM KV cache", kv, f"{tokens} tokens = {tokens // seq} sequences of {seq}"),
    ]
    budget.peak = engine
    budget.peak_phase = "rollout"
    budget.engine_sequences = tokens // seq
    return budget


def host_budgets(
    recipe: Recipe,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    layout: Layout,
    strategy: str,
    training: Budget,
    gpu: bool,
) -> list[Budget]:
    trainer = recipe.trainer
    assert trainer is not None
    sizes = _host_sizes(trainer, shape, critic_shape, layout, strategy, training, gpu)
    out = []
    for index, (ranks, engines, count) in enumerate(layout.node_kinds):
        title = f"host RAM per node (x{count}: {ranks} rank(s)" + (
            f", {engines} engine(s))" if engines else ")"
        )
        budget = Budget(title, count, _host_capacity(recipe.resources, ranks))
        items = budget.items
        if index == 0:
            items.append(Item("controller", int(HOST_PROCESS_GIB * GIB), "head node"))
            generation = generation_of(trainer, gpu)
            if generation.rounds > 1:
                items.append(
                    Item(
                        "rollouts of every sampling round",
                        generation.held_bytes(),
                        f"filter_groups: up to {generation.rounds} rounds of "
                        f"{generation.samples} samples, held until the step's groups are picked",
                    )
                )
        if ranks:
            items += _rank_host_items(trainer, shape, ranks, sizes, training, gpu)
        if trainer.layout == "split" and (engines or index == 0):
            items.append(_push_host_item(trainer, sizes))
        if engines:
            items += _engine_host_items(trainer, shape, engines, sizes)
        budget.peak = sum(i.bytes for i in items)
        budget.peak_phase = "steady"
        out.append(budget)
    return out


def _host_capacity(resources: Resources, ranks: int) -> int | None:
    """The host memory of a node that holds `ranks` training ranks, in bytes (None: not
    given)."""
    # resources.groups: training nodes hold ranks, rollout nodes only engines
    group = resources.train_nodes if ranks or resources.groups is None else None
    memory = (group or resources.rollout_nodes or resources).memory
    return None if memory is None else int(float(memory.rstrip("+")) * 1e9)


@dataclass(frozen=True)
class _HostSizes:
    """The figures every node's host budget is made of."""

    per_rank_host: int  # what a training rank holds in host memory
    ckpt_share: int  # a rank's share of a checkpoint
    adapter: int  # the LoRA adapter, float32 (0 without LoRA)
    engine_dtype: str
    engine_copy: int  # a copy of the weights in the engines' dtype
    bucket: int  # one push bucket
    cpu_engine_lora: int  # vLLM's LoRA slots and scratch per split engine on CPU


def _host_sizes(
    trainer: TrainerSettings,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    layout: Layout,
    strategy: str,
    training: Budget,
    gpu: bool,
) -> _HostSizes:
    _, master, _ = dtypes(trainer, gpu, strategy)
    engine_dtype = engine_dtype_name(trainer, gpu)
    engine_copy = mem.engine_weight_bytes(shape, dtype=engine_dtype)
    bucket_bytes = trainer.rollout.weight_sync_bucket_mb * 2**20
    bucket = mem.push_bucket_bytes(shape, dtype=engine_dtype, bucket_bytes=bucket_bytes)
    per_rank_host = sum(
        i.bytes for i in training.items if not gpu or i.note.endswith("in host memory")
    )
    if not gpu:  # everything of a CPU rank is in host memory: its peak
        per_rank_host = training.peak
    models = trained_models(trainer, shape, critic_shape)
    ckpt_share = checkpoint_size(models, master) // max(layout.train_ranks, 1)
    lora = trainer.model.lora
    adapter = 0 if lora is None else lora_sizes.adapter_bytes(shape, lora)
    # split engines on CPU: vLLM's LoRA slots and kernels' scratch are host memory
    cpu_engine_lora = 0
    if not gpu and trainer.layout == "split" and engine_of(trainer, gpu) == "vllm":
        tp = trainer.rollout.tensor_parallel_size
        per_worker = engine_lora_items(
            trainer, shape, dtype=engine_dtype, tensor_parallel=tp, gpu=False
        )
        cpu_engine_lora = tp * sum(i.bytes for i in per_worker)
    return _HostSizes(
        per_rank_host, ckpt_share, adapter, engine_dtype, engine_copy, bucket, cpu_engine_lora
    )


def _rank_host_items(
    trainer: TrainerSettings,
    shape: ModelShape,
    ranks: int,
    sizes: _HostSizes,
    training: Budget,
    gpu: bool,
) -> list[Item]:
    """The host memory of a node's training ranks."""
    items = [Item("training processes", ranks * int(HOST_PROCESS_GIB * GIB))]
    label = "training state and activations" if not gpu else "offloaded state"
    per_rank_host = sizes.per_rank_host
    if per_rank_host:
        items.append(Item(label, ranks * per_rank_host, f"{ranks} x {gib(per_rank_host)}"))
    items.append(Item("model loading", shape.params * 2, "safetensors pages, bf16"))
    if trainer.checkpoint.dir is not None:
        items.append(Item("checkpoint save/resume", ranks * sizes.ckpt_share, "each rank's shard"))
        if is_store_url(trainer.checkpoint.dir):
            items.append(
                Item(
                    "checkpoint upload buffers",
                    ranks * UPLOAD_BUFFER_BYTES,
                    "multipart parts in flight, per rank",
                )
            )
    if training.pinned_host:
        items.append(
            Item(
                "optimizer moments (host, pinned)",
                ranks * training.pinned_host,
                f"{ranks} x {gib(training.pinned_host)}, while vLLM generates",
            )
        )
    return items


def _push_host_item(trainer: TrainerSettings, sizes: _HostSizes) -> Item:
    """A split push on the sender's node and on each engine's.

    A split push streams buckets: at most two are under way (in the object store of the
    sender's node and of each engine's), and an engine loads one at a time. With rollouts
    ahead (max_staleness > 0) a push is queued whole behind the engines' rollouts: up to one
    copy of the weights waits in the object store."""
    if trainer.model.lora is not None:  # the adapter alone, from memory
        return Item("weight push", sizes.adapter, "the LoRA adapter, float32: all of it")
    if trainer.rollout.max_staleness > 0:
        return Item("weight push", sizes.engine_copy, "one queued copy (max_staleness > 0)")
    bucket = sizes.bucket
    return Item("weight push", 2 * bucket, f"2 buckets of {gib(bucket)} GiB in flight")


def _engine_host_items(
    trainer: TrainerSettings, shape: ModelShape, engines: int, sizes: _HostSizes
) -> list[Item]:
    """The host memory of a node's rollout engines."""
    items = [Item("rollout engine processes", engines * int(HOST_ENGINE_GIB * GIB))]
    lora = trainer.model.lora
    if lora is None:
        items.append(Item("engines' received bucket", engines * sizes.bucket, "deserialised"))
    else:
        loras = lora_sizes.vllm_max_loras(trainer.rollout)
        engine_dtype = sizes.engine_dtype
        kept = loras * lora_sizes.adapter_params(shape, lora) * mem.DTYPE_BYTES[engine_dtype]
        items.append(Item("engines' received adapter", engines * sizes.adapter, "deserialised"))
        items.append(
            Item(
                "engines' adapters (host)",
                engines * kept,
                f"vLLM's host copies of {loras} version(s), {engine_dtype}",
            )
        )
    if sizes.cpu_engine_lora:
        items.append(
            Item(
                "engines' LoRA slots and scratch",
                engines * sizes.cpu_engine_lora,
                "vLLM on CPU: host memory",
            )
        )
    return items
