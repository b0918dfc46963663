"""`rlx plan`: the memory a recipe needs, per GPU and per node, against what it asks for.

The plan follows the trainer as it is built: one training rank per GPU (one per node on
CPU), FSDP2 per decoder layer then the root when there is more than one rank (strategy
auto), float32 master weights, gradients and AdamW moments (sharded under FSDP), the
reference in the compute dtype, PPO's critic with its own AdamW, micro-batches of
micro_batch_size sequences or max_tokens_per_micro_batch tokens, chunked log-probs, and
rollout engines colocated (vLLM in the training process at gpu_memory_utilization, asleep
while training) or split onto their own GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlx.errors import RlxError
from rlx.plan import memory as mem
from rlx.plan.shapes import ModelShape, PlanError, find_shape
from rlx.recipe.model import (
    NodeGroup,
    Recipe,
    TrainerSettings,
    effective_strategy,
    episode_token_budget,
)
from rlx.storage import is_store_url
from rlx.trainer.rollout import choose_engine

GIB = mem.GIB
HEADROOM = 0.10  # a plan with less spare memory than this is a warning
RUNTIME_GIB = 2.0  # per GPU process: CUDA context, NCCL buffers, allocator slack
VLLM_RESERVE_GIB = 2.0  # inside vLLM's budget: its activation peak and CUDA graphs
# s3fs uploads a file in parts of 50 MiB, up to 10 at once (its max_concurrency): the host
# memory one rank's upload holds at its peak. gcsfs and adlfs hold less.
UPLOAD_BUFFER_BYTES = 10 * 50 * 2**20
HOST_PROCESS_GIB = 2.0  # per Ray actor or the controller: Python, torch, transformers
HOST_ENGINE_GIB = 4.0  # per split vLLM engine process


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


@dataclass
class MemoryPlan:
    recipe: str
    model: str
    accelerator: str | None
    strategy: str
    train_ranks: int
    gpus: list[Budget]
    hosts: list[Budget]
    checkpoint_bytes: int
    checkpoints_on_disk: int
    export_bytes: int
    staging_bytes: int = 0  # per node: the shards staged on local disk before an upload
    checkpoints_in_store: bool = False  # checkpoints_on_disk counts the store's copies
    episode_turns: int | None = None  # with an environment: model turns per episode at most
    episode_tokens: int = 0  # tokens after the prompt a rollout may hold (episode_token_budget)
    problems: list[str] = field(default_factory=list)  # does not fit: what to change
    warnings: list[str] = field(default_factory=list)  # fits, but tightly

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        def budget(b: Budget) -> dict[str, Any]:
            return {
                "title": b.title,
                "count": b.count,
                "capacity_bytes": b.capacity,
                "peak_bytes": b.peak,
                "peak_phase": b.peak_phase,
                "fits": b.fits,
                "headroom": None if b.headroom is None else round(b.headroom, 4),
                "items": [asdict(item) for item in b.items],
            }

        return {
            "recipe": self.recipe,
            "model": self.model,
            "accelerator": self.accelerator,
            "strategy": self.strategy,
            "train_ranks": self.train_ranks,
            "gpus": [budget(b) for b in self.gpus],
            "hosts": [budget(b) for b in self.hosts],
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoints_on_disk_bytes": self.checkpoints_on_disk,
            "export_bytes": self.export_bytes,
            "staging_bytes_per_node": self.staging_bytes,
            "episode_turns": self.episode_turns,
            "episode_tokens": self.episode_tokens,
            "fits": self.fits,
            "problems": self.problems,
            "warnings": self.warnings,
        }


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Layout:
    """How many of each actor, and what the busiest nodes hold."""

    train_ranks: int
    engines: int  # split rollout engines
    tp: int
    # (training ranks, split engines) per distinct kind of node, with how many such nodes
    node_kinds: tuple[tuple[int, int, int], ...]


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


def _dtypes(trainer: TrainerSettings, gpu: bool, strategy: str) -> tuple[str, str, str]:
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


def micro_batch_tokens(trainer: TrainerSettings, ranks: int) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch: max_tokens_per_micro_batch, or
    min(micro_batch_size, a rank's share of a minibatch) sequences of prompt + response (with
    an environment, the longest episode: every turn and observation after the prompt)."""
    batch = trainer.batch
    prompt, response = trainer.data.max_prompt_length, episode_token_budget(trainer)
    if batch.max_tokens_per_micro_batch is not None:
        budget = max(batch.max_tokens_per_micro_batch, prompt + response)
        return budget, budget  # responses may fill the budget: the logits' worst case
    samples = batch.prompts_per_step * trainer.rollout.n
    share = max((batch.minibatch_size or samples) // max(ranks, 1), 1)
    rows = min(batch.micro_batch_size, share)
    return rows * (prompt + response), rows * response


def plan_recipe(
    recipe: Recipe, env: Mapping[str, str] | None = None, *, advise: bool = True
) -> MemoryPlan:
    """The memory plan of a recipe with a trainer section (PlanError if it has none, or its
    model or accelerator is unknown). advise: say which single changes make a budget that
    does not fit fit (by planning each changed recipe)."""
    trainer = recipe.trainer
    if trainer is None:
        raise PlanError(f"recipe {recipe.name!r} has no trainer section; nothing to plan")
    shape = find_shape(trainer.model.path, env)
    critic_shape = None
    if trainer.algorithm == "ppo":
        critic_shape = find_shape((trainer.critic_model or trainer.model).path, env)
    resources = recipe.resources
    gpu = resources.gpus_per_node > 0
    capacity = _gpu_capacity(resources.train_nodes) if gpu else None
    rollout_nodes = resources.rollout_nodes
    # resources.groups: the engines run on the rollout group's GPUs, of their own size
    rollout_capacity = capacity if rollout_nodes is None else _gpu_capacity(rollout_nodes)
    accelerator = resources.accelerators
    if rollout_nodes is not None:
        accelerator = (
            f"train {resources.train_nodes.nodes} x {resources.train_nodes.accelerators or 'CPU'}"
            f", rollout {rollout_nodes.nodes} x {rollout_nodes.accelerators or 'CPU'}"
        )
    layout = layout_of(recipe)
    strategy = effective_strategy(trainer.parallel.strategy, layout.train_ranks)
    plan = MemoryPlan(
        recipe=recipe.name,
        model=f"{trainer.model.path}: {shape.describe()}",
        accelerator=accelerator,
        strategy=strategy,
        train_ranks=layout.train_ranks,
        gpus=[],
        hosts=[],
        checkpoint_bytes=0,
        checkpoints_on_disk=0,
        export_bytes=0,
        episode_turns=None if trainer.environment is None else trainer.environment.max_turns,
        episode_tokens=episode_token_budget(trainer),
    )
    compute, master, _ = _dtypes(trainer, gpu, strategy)
    training = _training_budget(trainer, shape, critic_shape, layout, strategy, gpu, capacity)
    if gpu:
        plan.gpus.append(training)
        if trainer.layout == "split" and layout.engines:
            plan.gpus.append(_rollout_budget(trainer, shape, layout, rollout_capacity or 0))
    plan.hosts = _host_budgets(recipe, shape, critic_shape, layout, strategy, training, gpu)
    critic_params = critic_shape.critic_params if critic_shape else 0
    plan.checkpoint_bytes = mem.checkpoint_bytes(shape.params, critic_params, param_dtype=master)
    # keep complete checkpoints plus the one being written before the oldest is pruned
    plan.checkpoints_on_disk = plan.checkpoint_bytes * (trainer.checkpoint.keep + 1)
    plan.export_bytes = shape.params * mem.DTYPE_BYTES[compute]
    if trainer.checkpoint.dir is None:
        plan.checkpoints_on_disk = 0
    elif is_store_url(trainer.checkpoint.dir):
        # Each node stages its ranks' shards (rank 0's node: the small parts and hf/ too)
        # before uploading them; the store keeps the retained copies, not the node.
        plan.checkpoints_in_store = True
        most_ranks = max((ranks for ranks, _, _ in layout.node_kinds), default=1)
        share = plan.checkpoint_bytes // max(layout.train_ranks, 1)
        plan.staging_bytes = most_ranks * share
        disk = recipe.resources.train_nodes.disk_size  # only training nodes stage shards
        if disk is not None and plan.staging_bytes > int(disk) * GIB:
            plan.problems.append(
                f"checkpoint staging: {gib(plan.staging_bytes)} GiB of shards per node before "
                f"the upload, more than resources.disk_size {disk} GB; raise disk_size"
            )
    _verdict(plan, recipe, env, advise)
    return plan


def _gpu_capacity(group: NodeGroup) -> int | None:
    """Bytes of one of the group's GPUs (None for CPU-only nodes); PlanError when its type
    is not in the table."""
    if not group.gpus_per_node:
        return None
    name = group.accelerator_type or ""
    size = mem.accelerator_gib(name)
    if size is None:
        known = ", ".join(mem.ACCELERATOR_GIB)
        raise PlanError(f"accelerator {name!r} has no memory size in the plan's table: {known}")
    return int(size * GIB)


def _training_budget(
    trainer: TrainerSettings,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    layout: Layout,
    strategy: str,
    gpu: bool,
    capacity: int | None,
) -> Budget:
    parallel = trainer.parallel
    ranks = layout.train_ranks
    compute, master, residual = _dtypes(trainer, gpu, strategy)
    offload = parallel.offload_optimizer and strategy == "fsdp"
    title = f"training GPU (x{ranks})" if gpu else "training rank (host)"
    budget = Budget(title, ranks, capacity)
    items = budget.items

    def state(label: str, s: ModelShape, params: int) -> int:
        st = mem.training_state_bytes(
            s,
            ranks=ranks,
            strategy=strategy,
            offload_optimizer=offload,
            param_dtype=master,
            params=params,
        )
        note = (
            f"{master}"
            + (", sharded" if strategy == "fsdp" else "")
            + (", in host memory" if offload else "")
        )
        phase = "" if offload else "all"
        items.append(Item(f"{label} weights", st["weights"], note, phase))
        items.append(Item(f"{label} grads", st["grads"], note, phase))
        items.append(Item(f"{label} optimizer (AdamW)", st["optimizer"], note, phase))
        if st["ddp_buckets"]:
            items.append(Item(f"{label} DDP gradient buckets", st["ddp_buckets"], "ddp"))
        return st["device"]

    resident = state("policy", shape, shape.params)
    if trainer.algo.kl.coef > 0:
        ref = mem.reference_bytes(shape, ranks=ranks, strategy=strategy, dtype=compute)
        on_host = parallel.offload_reference and strategy == "fsdp"
        note = compute + (", sharded" if strategy == "fsdp" else "")
        items.append(
            Item(
                "reference",
                ref,
                note + (", in host memory" if on_host else ""),
                "" if on_host else "all",
            )
        )
        resident += 0 if on_host else ref
    if critic_shape is not None:
        resident += state("critic", critic_shape, critic_shape.critic_params)
    if gpu:
        items.append(Item("runtime (CUDA, NCCL, allocator)", int(RUNTIME_GIB * GIB)))
        resident += int(RUNTIME_GIB * GIB)

    tokens, response_tokens = micro_batch_tokens(trainer, ranks)
    models = [shape] + ([critic_shape] if critic_shape is not None else [])
    # One flag for both models' rows: either model checkpointing counts as checkpointed
    # (the shipped recipes set the critic's like the policy's).
    checkpointing = [trainer.model.gradient_checkpointing]
    if critic_shape is not None:
        checkpointing.append((trainer.critic_model or trainer.model).gradient_checkpointing)
    act = {
        flag: max(
            mem.activation_bytes(
                s, tokens, dtype=compute, residual_dtype=residual, checkpointing=flag
            )
            for s in models
        )
        for flag in (False, True)
    }
    used = any(checkpointing)
    items.append(
        Item(
            "activations, no checkpointing",
            act[False],
            f"{tokens} tokens per micro-batch",
            "" if used else "update",
        )
    )
    items.append(
        Item(
            "activations, gradient checkpointing",
            act[True],
            f"{tokens} tokens per micro-batch",
            "update" if used else "",
        )
    )
    chunk = mem.logits_chunk_tokens(shape)
    logits = mem.logits_peak_bytes(shape, response_tokens, dtype=compute, chunk_tokens=chunk)
    note = f"chunks of {min(chunk, response_tokens)} of {response_tokens} response tokens"
    items.append(Item("logits peak", logits, note, "update"))
    gathered = max(
        mem.gathered_params_bytes(
            s,
            strategy=strategy,
            ranks=ranks,
            dtype=compute,
            reshard_after_forward=parallel.reshard_after_forward,
        )
        for s in models
    )
    if gathered:
        items.append(
            Item("gathered params (FSDP)", gathered, f"{compute}, root + layers", "update")
        )
    train_peak = resident + act[used] + logits + gathered
    budget.peak, budget.peak_phase = train_peak, "update"

    if _colocated_vllm(trainer, gpu):
        util = trainer.rollout.gpu_memory_utilization
        engine = int(util * (capacity or 0))
        weights = mem.engine_weight_bytes(shape, dtype=compute)
        kv = max(engine - weights - int(VLLM_RESERVE_GIB * GIB), 0)  # its budget, as split
        seq = sequence_tokens(trainer)
        budget.engine_sequences = kv // mem.kv_bytes_per_token(shape, dtype=compute) // seq
        items.append(Item("vLLM weights (colocated)", weights, "in the budget below", ""))
        items.append(Item("vLLM KV cache (colocated)", kv, "in the budget below", ""))
        items.append(
            Item(
                "vLLM budget (colocated)", engine, f"{util} of the GPU, asleep in update", "rollout"
            )
        )
        rollout_peak = resident + engine
        if rollout_peak > budget.peak:
            budget.peak, budget.peak_phase = rollout_peak, "rollout"
    return budget


def _colocated_vllm(trainer: TrainerSettings, gpu: bool) -> bool:
    """Training GPUs that also hold a vLLM engine: the engine the trainer chooses (on GPUs
    only; the count of GPUs does not change the choice)."""
    engine = choose_engine(trainer.rollout.engine, gpus_per_node=int(gpu))
    return gpu and trainer.layout == "colocated" and engine == "vllm"


def _rollout_budget(
    trainer: TrainerSettings, shape: ModelShape, layout: Layout, capacity: int
) -> Budget:
    compute = trainer.model.dtype if trainer.model.dtype != "auto" else "bfloat16"
    tp = layout.tp
    util = trainer.rollout.gpu_memory_utilization
    budget = Budget(
        f"rollout GPU (x{layout.engines * tp}, {layout.engines} engine(s) of tp {tp})",
        layout.engines * tp,
        capacity,
    )
    weights = mem.engine_weight_bytes(shape, dtype=compute, tensor_parallel=tp)
    engine = int(util * capacity)
    reserve = int(VLLM_RESERVE_GIB * GIB)
    kv = max(engine - weights - reserve, 0)
    per_token = mem.kv_bytes_per_token(shape, dtype=compute, tensor_parallel=tp)
    tokens = kv // per_token
    seq = sequence_tokens(trainer)
    # vLLM sizes its KV cache so that everything it holds, CUDA context included, stays
    # within gpu_memory_utilization of the GPU: its budget is the GPU's peak.
    budget.items += [
        Item("vLLM weights", weights, f"{compute}, 1/{tp} of the model"),
        Item("vLLM activations, graphs, CUDA", reserve, "inside its budget"),
        Item("vLLM KV cache", kv, f"{tokens} tokens = {tokens // seq} sequences of {seq}"),
    ]
    budget.peak = engine
    budget.peak_phase = "rollout"
    budget.engine_sequences = tokens // seq
    return budget


def _host_budgets(
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
    resources = recipe.resources

    def host_capacity(ranks: int) -> int | None:
        # resources.groups: training nodes hold ranks, rollout nodes only engines
        group = resources.train_nodes if ranks or resources.groups is None else None
        memory = (group or resources.rollout_nodes or resources).memory
        return None if memory is None else int(float(memory.rstrip("+")) * 1e9)

    compute, master, _ = _dtypes(trainer, gpu, strategy)
    engine_dtype = compute if gpu else "bfloat16"
    engine_copy = mem.engine_weight_bytes(shape, dtype=engine_dtype)
    bucket_bytes = trainer.rollout.weight_sync_bucket_mb * 2**20
    bucket = mem.push_bucket_bytes(shape, dtype=engine_dtype, bucket_bytes=bucket_bytes)
    per_rank_host = sum(
        i.bytes for i in training.items if not gpu or i.note.endswith("in host memory")
    )
    if not gpu:  # everything of a CPU rank is in host memory: its peak
        per_rank_host = training.peak
    critic_params = critic_shape.critic_params if critic_shape else 0
    ckpt_share = mem.checkpoint_bytes(shape.params, critic_params, param_dtype=master) // max(
        layout.train_ranks, 1
    )
    out = []
    for index, (ranks, engines, count) in enumerate(layout.node_kinds):
        title = f"host RAM per node (x{count}: {ranks} rank(s)" + (
            f", {engines} engine(s))" if engines else ")"
        )
        budget = Budget(title, count, host_capacity(ranks))
        items = budget.items
        if index == 0:
            items.append(Item("controller", int(HOST_PROCESS_GIB * GIB), "head node"))
        if ranks:
            items.append(Item("training processes", ranks * int(HOST_PROCESS_GIB * GIB)))
            label = "training state and activations" if not gpu else "offloaded state"
            if per_rank_host:
                items.append(Item(label, ranks * per_rank_host, f"{ranks} x {gib(per_rank_host)}"))
            items.append(Item("model loading", shape.params * 2, "safetensors pages, bf16"))
            if trainer.checkpoint.dir is not None:
                items.append(
                    Item("checkpoint save/resume", ranks * ckpt_share, "each rank's shard")
                )
                if is_store_url(trainer.checkpoint.dir):
                    items.append(
                        Item(
                            "checkpoint upload buffers",
                            ranks * UPLOAD_BUFFER_BYTES,
                            "multipart parts in flight, per rank",
                        )
                    )
            if _colocated_vllm(trainer, gpu):
                items.append(
                    Item("vLLM weights asleep", ranks * engine_copy, "sleep mode keeps them here")
                )
        # A split push streams buckets: at most two are under way (in the object store of
        # the sender's node and of each engine's), and an engine loads one at a time. With
        # rollouts ahead (max_staleness > 0) a push is queued whole behind the engines'
        # rollouts: up to one copy of the weights waits in the object store.
        if trainer.layout == "split" and (engines or index == 0):
            if trainer.rollout.max_staleness > 0:
                items.append(
                    Item("weight push", engine_copy, "one queued copy (max_staleness > 0)")
                )
            else:
                items.append(
                    Item("weight push", 2 * bucket, f"2 buckets of {gib(bucket)} GiB in flight")
                )
        if engines:
            items.append(Item("rollout engine processes", engines * int(HOST_ENGINE_GIB * GIB)))
            items.append(Item("engines' received bucket", engines * bucket, "deserialised"))
        budget.peak = sum(i.bytes for i in items)
        budget.peak_phase = "steady"
        out.append(budget)
    return out


# --------------------------------------------------------------------------- verdict


def _verdict(plan: MemoryPlan, recipe: Recipe, env: Mapping[str, str] | None, advise: bool) -> None:
    for budget in [*plan.gpus, *plan.hosts]:
        if budget.capacity is None:
            continue
        where = budget.title.split(" (")[0]
        if not budget.fits:
            plan.problems.append(
                f"{where}: needs {gib(budget.peak)} GiB of {gib(budget.capacity)} GiB "
                f"({_largest(budget)})" + (f"; {_advice(recipe, budget, env)}" if advise else "")
            )
        elif budget.headroom is not None and budget.headroom < HEADROOM:
            plan.warnings.append(
                f"{where}: needs {gib(budget.peak)} GiB of {gib(budget.capacity)} GiB, only "
                f"{budget.headroom:.0%} spare (keep {HEADROOM:.0%}): {_largest(budget)}"
            )
    for budget in plan.gpus:
        if budget.engine_sequences == 0:
            where = budget.title.split(" (")[0]
            plan.problems.append(
                f"{where}: vLLM's share (gpu_memory_utilization) leaves no room for the KV "
                f"cache of one {_sequence(recipe)}-token sequence ({_engine_items(budget)}); "
                + (
                    "raise rollout.gpu_memory_utilization or tensor_parallel_size (layout: "
                    f"split), or shorten {_longest_setting(recipe)}"
                )
            )


def _sequence(recipe: Recipe) -> int:
    trainer = recipe.trainer
    assert trainer is not None
    return sequence_tokens(trainer)


def _longest_setting(recipe: Recipe) -> str:
    """The setting that bounds a sequence after its prompt."""
    trainer = recipe.trainer
    assert trainer is not None
    if trainer.environment is None:
        return "max_new_tokens"
    return "environment.max_tokens" + (
        " (unset: max_turns x 2 x max_new_tokens)" if trainer.environment.max_tokens is None else ""
    )


def _engine_items(budget: Budget) -> str:
    return ", ".join(f"{i.name} {gib(i.bytes)}" for i in budget.items if "vLLM" in i.name)


def _largest(budget: Budget, top: int = 4) -> str:
    counted = sorted((i for i in budget.items if budget.in_peak(i)), key=lambda i: -i.bytes)
    return ", ".join(f"{i.name} {gib(i.bytes)}" for i in counted[:top])


def _advice(recipe: Recipe, budget: Budget, env: Mapping[str, str] | None) -> str:
    """The single changes that make this budget fit, tried one by one on the recipe."""
    trainer = recipe.trainer
    assert trainer is not None
    if budget.title.startswith("host"):
        need = -(-budget.peak // 10**9)
        return f"ask for resources.memory: '{need}+' (GB per node), or fewer ranks per node"
    tries: list[tuple[str, dict[str, Any]]] = []
    if budget.title.startswith("training"):
        parallel = trainer.parallel
        if parallel.strategy == "ddp":
            tries.append(("parallel.strategy: fsdp", {"parallel": {"strategy": "fsdp"}}))
        for nodes in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            if nodes > recipe.resources.nodes and _splits_evenly(recipe, nodes):
                tries.append((f"resources.nodes: {nodes}", {"resources": {"nodes": nodes}}))
        if not parallel.offload_optimizer:
            tries.append(
                (
                    "parallel.offload_optimizer: true",
                    {"parallel": {"offload_optimizer": True}},
                )
            )
        if not parallel.offload_reference and trainer.algo.kl.coef > 0:
            tries.append(
                (
                    "parallel.offload_reference: true",
                    {"parallel": {"offload_reference": True}},
                )
            )
        if not trainer.model.gradient_checkpointing:
            tries.append(
                ("model.gradient_checkpointing: true", {"model": {"gradient_checkpointing": True}})
            )
        mbs = trainer.batch.micro_batch_size
        while mbs > 1:
            mbs //= 2
            tries.append((f"batch.micro_batch_size: {mbs}", {"batch": {"micro_batch_size": mbs}}))
        if trainer.layout == "colocated" and recipe.resources.gpus_per_node > 0:
            util = trainer.rollout.gpu_memory_utilization
            for lower in (0.4, 0.3, 0.2):
                if lower < util:
                    tries.append(
                        (
                            f"rollout.gpu_memory_utilization: {lower}",
                            {"rollout": {"gpu_memory_utilization": lower}},
                        )
                    )
            half = recipe.resources.total_gpus // 2
            if half:
                tries.append(
                    (
                        f"layout: split with rollout_gpus: {half}",
                        {"layout": "split", "rollout_gpus": half},
                    )
                )
    else:
        tp = trainer.rollout.tensor_parallel_size
        for bigger in (2, 4, 8):
            if bigger > tp and recipe.resources.engine_gpus_per_node % bigger == 0:
                tries.append(
                    (
                        f"rollout.tensor_parallel_size: {bigger}",
                        {"rollout": {"tensor_parallel_size": bigger}},
                    )
                )
        tries.append(
            ("rollout.gpu_memory_utilization: 0.9", {"rollout": {"gpu_memory_utilization": 0.9}})
        )
    working: list[str] = []
    kind = budget.title.split(" (")[0]
    for label, change in tries:
        # the fewest nodes that fit is enough
        if label.startswith("resources.nodes") and any(w.startswith("resources.") for w in working):
            continue
        try:
            replan = plan_recipe(_changed(recipe, change), env, advise=False)
        except (RlxError, ValueError):  # a change the recipe cannot take
            continue
        match = [b for b in replan.gpus + replan.hosts if b.title.split(" (")[0] == kind]
        if match and all(b.fits for b in match):
            working.append(label)
        if len(working) == 3:
            break
    if not working:
        return "no single change fits it: use more GPUs with more memory or a smaller model"
    return "to fit, change one of: " + "; ".join(working)


def _splits_evenly(recipe: Recipe, nodes: int) -> bool:
    """Whether a step and a minibatch still split evenly over the ranks `nodes` give."""
    trainer = recipe.trainer
    assert trainer is not None
    gpus = recipe.resources.gpus_per_node
    ranks = nodes * gpus - (trainer.rollout_gpus if trainer.layout == "split" else 0)
    ranks = ranks if gpus else nodes
    samples = trainer.batch.prompts_per_step * trainer.rollout.n
    minibatch = trainer.batch.minibatch_size or samples
    return ranks > 0 and samples % ranks == 0 and minibatch % ranks == 0


def _changed(recipe: Recipe, change: dict[str, Any]) -> Recipe:
    data = recipe.model_dump()
    resources = change.pop("resources", None) if "resources" in change else None
    if resources:
        data["resources"].update(resources)
    for key, value in change.items():
        if isinstance(value, dict):
            data["trainer"][key].update(value)
        else:
            data["trainer"][key] = value
    return Recipe.model_validate(data)
