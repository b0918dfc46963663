"""The Ray actors: training workers (one per GPU, or one per node on CPU) and rollout workers
(layout: split). Plain classes, wrapped with ray.remote where they are placed (cluster.py);
each method moves tensors in and out and calls the Learner or an engine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlx import procfs
from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.runs import GPU_FREE, GPU_PEAK, GPU_RESERVED
from rlx.trainer.actors.placement import threads_for
from rlx.trainer.allocator import keep_freed_memory, use_allocator_settings
from rlx.trainer.background import Background
from rlx.trainer.batch import RolloutBatch, SequenceBatch
from rlx.trainer.checkpoint import capture_rng_state, restore_rng_state
from rlx.trainer.checkpoint.protocol import (
    Checkpoints,
    Finished,
    Location,
    SavedCheckpoint,
    SaveRequest,
)
from rlx.trainer.checkpoint.training import (
    LEARNER_PARTS,
    LEARNER_STATE,
    WORKER_RNG,
    LoadReport,
    load_learner_state,
)
from rlx.trainer.collector import settle
from rlx.trainer.job import runs_ahead
from rlx.trainer.learn.learner import Learner, UpdateStats, needs_old_logprobs
from rlx.trainer.learn.models import autocast
from rlx.trainer.model import cpu_linear
from rlx.trainer.rollout import engine_class, engine_for_job
from rlx.trainer.rollout.base import EngineSite, RolloutEngine, SamplingArgs
from rlx.trainer.rollout.colocated import ColocatedEngine, make_colocated_engine
from rlx.trainer.rollout.probe import EngineReport, Probe
from rlx.trainer.seeding import derive_seed
from rlx.trainer.stall import collective_failure, hang_if_asked, process_group_timeout
from rlx.trainer.weights import (
    BucketLayout,
    GroupAddress,
    Traffic,
    WeightGroup,
    WeightSender,
    dtype_named,
)

GIB = 2**30


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build itself (picklable; no Ray handles)."""

    settings: TrainerSettings
    policy_path: str
    critic_path: str | None
    rank: int
    world_size: int
    node_share: int  # actors of this job on the worker's node (they share its cores)
    num_threads: int | None  # RLX_NUM_THREADS, when set
    engine_kind: str  # "hf" | "vllm" (resolved), for the colocated or split engine
    engine_dtype: str  # the engines' weights dtype (TrainJob.engine_dtype)
    colocated: bool  # training workers hold the engines
    use_gpu: bool
    # How the training ranks share the models (rlx.plan.strategy.choose_strategy, decided
    # once for the run); None: the recipe's explicit setting (a worker built on its own).
    strategy: str | None = None
    # Whether rollouts run ahead of the update (TrainJob.ahead); None: the recipe's, likewise.
    ahead: bool | None = None

    @property
    def rollouts_ahead(self) -> bool:
        return runs_ahead(self.settings) if self.ahead is None else self.ahead


def on_this_node(spec: WorkerSpec) -> WorkerSpec:
    """spec with its model paths as folders on this worker's node (fetched from a store, or
    a tiny model built here, when the head's copy is not on a shared disk)."""
    from rlx.trainer.resolve import node_model_path

    settings = spec.settings
    policy = node_model_path(spec.policy_path, settings.model.path, settings.seed)
    critic = spec.critic_path
    if critic is not None:
        source = (settings.critic_model or settings.model).path
        field = "critic_model" if settings.critic_model is not None else "model"
        critic = node_model_path(critic, source, settings.seed, field)
    return dataclasses.replace(spec, policy_path=policy, critic_path=critic)


@dataclass
class UpdateOutcome:
    """What TrainWorker.update returns: the rank's update numbers, its engine's report and
    policy probe value (colocated), and the seconds spent preparing and refreshing."""

    stats: UpdateStats
    refresh: tuple[EngineReport, float] | None
    prepare_seconds: float
    refresh_seconds: float
    gpu: dict[str, float] = dataclasses.field(default_factory=dict)  # gpu_memory's figures


def _prepare_process(spec: WorkerSpec, stream: str, holds_engine: bool) -> torch.device:
    from rlx.trainer.learn.models import quiet_transformers

    settle(started=False)  # this module's imports are in (rlx/trainer/collector.py)
    keep_default = holds_engine and engine_class(spec.engine_kind).keeps_default_allocator
    use_allocator_settings(spec.use_gpu, keep_default)
    quiet_transformers()
    if not spec.use_gpu:  # the host computes: its freed tensors stay for the next ones
        keep_freed_memory()
    # Ray sets OMP_NUM_THREADS=1 in its workers; torch then uses one core unless told.
    torch.set_num_threads(threads_for(spec.node_share, spec.num_threads))
    torch.manual_seed(derive_seed(spec.settings.seed, stream, spec.rank))
    if spec.use_gpu and not torch.cuda.is_available():
        raise RlxError(
            f"Ray gave this worker a GPU but torch {torch.__version__} here sees none (a CPU "
            "build of torch, or no driver); install a CUDA build of torch in setup"
        )
    return torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")


def gpu_memory(device: torch.device) -> dict[str, float]:
    """This rank's GPU memory since the last call, in GiB (none on CPU): the peak torch
    allocated, what its allocator holds, and what the device has free (vLLM's memory
    included); the peak is measured afresh from here."""
    if device.type != "cuda":
        return {}
    free, _ = torch.cuda.mem_get_info(device)
    figures = {
        GPU_PEAK: torch.cuda.max_memory_allocated(device) / GIB,
        GPU_RESERVED: torch.cuda.memory_reserved(device) / GIB,
        GPU_FREE: free / GIB,
    }
    torch.cuda.reset_peak_memory_stats(device)
    return figures


def merge_gpu_memory(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One figure each over the ranks: the largest peak and reserve, the least free."""
    if not any(per_rank):
        return {}
    ranks = [figures for figures in per_rank if figures]
    return {
        GPU_PEAK: max(f[GPU_PEAK] for f in ranks),
        GPU_RESERVED: max(f[GPU_RESERVED] for f in ranks),
        GPU_FREE: min(f[GPU_FREE] for f in ranks),
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def memory_peak(reset: bool) -> int:
    """Peak resident bytes of this process since the last reset; reset=True starts the
    measurement afresh and returns the resident bytes now."""
    if reset:
        procfs.reset_peak_rss()
        return procfs.rss_bytes()
    return procfs.peak_rss_bytes()


def prepare_ray_executor() -> None:
    """What vLLM's Ray executor needs in the actor of a tensor-parallel engine on GPUs (the
    engine's own options and environment: vllm_options): its engine core runs in a child
    process that joins this Ray cluster (by RAY_ADDRESS) and finds the actor's placement
    group through vLLM."""
    import ray

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    # The actor holds no GPU; Ray versions that blank the variable for such an actor
    # (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO) would hide the node's GPUs from vLLM's driver.
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]


def _probe_ids(probe: Probe) -> tuple[list[int], list[int]]:
    return probe.prompt_ids, probe.response_ids


Method = TypeVar("Method", bound=Callable[..., Any])


def _collectives(phase: str) -> Callable[[Method], Method]:
    """A TrainWorker method whose collectives (FSDP's, DDP's) may fail on a peer gone or
    silent past the process group's timeout: that failure as one line naming this rank,
    its node and the phase (stall.collective_failure), exit 75."""

    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def run(self: TrainWorker, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except RuntimeError as exc:
                spec = self.spec
                if spec.world_size < 2:
                    raise
                timeout = process_group_timeout(spec.settings.stall_timeout)
                failed = collective_failure(exc, spec.rank, _node_ip(), phase, timeout)
                if failed is None:
                    raise
                raise failed from None

        return run  # type: ignore[return-value]

    return wrap


_GENERATE_CALLS = [0]  # this worker's generate calls, for the test hook (stall.py)


def _generate(
    engine: RolloutEngine, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int
) -> RolloutBatch:
    _GENERATE_CALLS[0] += 1
    hang_if_asked(_GENERATE_CALLS[0])
    # no_grad, not inference_mode: a sharded policy's gathered weights must stay writable.
    with torch.no_grad():
        return engine.generate(prompt_ids, sampling, seed=seed)


class TrainWorker:
    """One data-parallel rank: a Learner, and in layout: colocated its rollout engine."""

    def __init__(self, spec: WorkerSpec):
        self.device = _prepare_process(spec, "train-worker", holds_engine=spec.colocated)
        self.spec = spec = on_this_node(spec)
        self.learner: Learner | None = None
        self.engine: ColocatedEngine | None = None
        self._pending_save: Background | Finished | None = None  # a store upload under way
        self._sender: WeightSender | None = None  # rank 0: the push's end, to the split engines

    # ------------------------------------------------------------------ set-up

    def node_ip(self) -> str:
        return _node_ip()

    def free_port(self) -> int:
        """A port free on this node now, for the torch.distributed rendezvous (rank 0)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def setup(self, master_addr: str, master_port: int) -> tuple[list[str], float | None]:
        """Join the process group, build the Learner and (colocated) the engine; returns
        notes for the run's log and, when the passes are packed, what a sequence's length
        costs (rlx.trainer.packing.attention_weight) for balancing the ranks' shares."""
        spec = self.spec
        notes: list[str] = []
        if spec.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(
                # gloo beside nccl: FSDP's CPU offload reduces host tensors (grad norms).
                "cpu:gloo,cuda:nccl" if spec.use_gpu else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=spec.rank,
                world_size=spec.world_size,
                # A rank whose peer never comes raises after this (stall.py), not never.
                timeout=timedelta(seconds=process_group_timeout(spec.settings.stall_timeout)),
            )
        # An engine that loads the policy's starting weights from its files (vLLM) starts
        # before the learner fills the GPU: it sizes its share (gpu_memory_utilization) from
        # memory that is still free.
        if spec.colocated and engine_class(spec.engine_kind).starts_before_learner:
            self.engine = self._colocated_engine(None, None, notes)
        self.learner = Learner(
            spec.settings,
            spec.policy_path,
            spec.critic_path,
            self.device,
            rank=spec.rank,
            world_size=spec.world_size,
            strategy=spec.strategy,  # type: ignore[arg-type]
            ahead=spec.rollouts_ahead,
        )
        if spec.colocated and self.engine is None:
            self.engine = self._colocated_engine(
                self.learner.policy, self.learner.collective, notes
            )
        planner = self.learner.planner  # how the update's passes are planned
        notes.append(planner.note)
        if self.device.type == "cpu":
            notes.append(cpu_linear.describe())
        settle(started=True)
        return notes, planner.attention_weight if planner.packing else None

    def _colocated_engine(self, policy: Any, collective: Any, notes: list[str]) -> ColocatedEngine:
        spec = self.spec
        site = EngineSite(spec.policy_path, spec.use_gpu, in_process=True)
        options = engine_class(spec.engine_kind).options_from(spec.settings, site)
        return make_colocated_engine(
            spec.engine_kind,
            policy,
            spec.policy_path,
            dtype=spec.engine_dtype,
            options=options,
            collective=collective,
            say=notes.append,
            bucket_bytes=spec.settings.rollout.weight_sync_bucket_mb * 2**20,
        )

    def _learner(self) -> Learner:
        if self.learner is None:
            raise RuntimeError("setup() was not called")
        return self.learner

    # ------------------------------------------------------------------ the step

    @_collectives("generation")
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int) -> Any:
        if self.engine is None:
            raise RuntimeError("this worker holds no engine (layout: split)")
        learner = self._learner()
        # HF generate over the float32 master weights on GPU: bf16 compute, as training.
        with autocast(self.device, learner.dtype), learner.no_grad():
            engine = self.engine.engine
            if not prompt_ids:  # a sharded policy: join the other ranks' forwards
                engine.take_part(sampling.max_new_tokens)
                return None
            return _generate(engine, prompt_ids, sampling, seed)

    @_collectives("forwards (prepare)")
    def prepare(self, batch: SequenceBatch, old_logprobs: bool) -> dict[str, torch.Tensor]:
        if self.engine is not None:
            self.engine.release(self.learner)
        return self._learner().prepare(batch, old_logprobs=old_logprobs)

    @_collectives("update")
    def update(
        self, batch: SequenceBatch, step: int, prepare: bool, probe: Probe | None
    ) -> UpdateOutcome:
        """The step's update on this rank, in one call: first the forwards the advantages did
        not need (prepare: reference and old log-probs), then the update, then with a probe
        (colocated) the engine brought to the new weights, version `step`."""
        if self.engine is not None:
            self.engine.release(self.learner)
        learner = self._learner()
        started = time.perf_counter()
        if prepare:
            old_logprobs = needs_old_logprobs(self.spec.settings, self.spec.rollouts_ahead)
            batch = batch.with_fields(**learner.prepare(batch, old_logprobs=old_logprobs))
        prepared = time.perf_counter()
        stats = learner.update(batch, step)
        updated = time.perf_counter()
        refresh = None if probe is None else self.refresh_engine(step, probe)
        return UpdateOutcome(
            stats,
            refresh,
            prepare_seconds=prepared - started,
            refresh_seconds=time.perf_counter() - updated,
            gpu=gpu_memory(self.device),  # the step's generate (colocated) and update
        )

    def refresh_engine(self, version: int, probe: Probe) -> tuple[EngineReport, float]:
        """Colocated: bring this worker's engine to the policy's weights; report it, with
        this rank's policy probe value. An engine sharing the policy module scores the very
        tensors the policy would, so its value stands for both (one forward, not two); the
        check then compares every rank's engine with rank 0's policy."""
        if self.engine is None:
            raise RuntimeError("this worker holds no engine (layout: split)")
        learner = self._learner()
        self.engine.refresh(learner.policy, version, learner)
        engine = self.engine.engine
        with learner.no_grad():
            value = engine.logprob_probe(probe.prompt_ids, probe.response_ids)
        own = value if self.engine.shares_policy else learner.probe(*_probe_ids(probe))
        return EngineReport(self.spec.rank, _node_ip(), engine.weight_version, value), own

    def push_bytes(self, dtype: str | None) -> int:
        """Colocated: bytes a refresh hands this worker's engine (the pushed parameters in
        the engine's dtype); 0 when the engine runs the policy's own module."""
        from rlx.trainer.model.push import pushed_parameters

        if self.engine is None or self.engine.shares_policy:
            return 0
        wanted = None if dtype in (None, "auto") else dtype_named(dtype)
        return sum(
            p.numel() * (wanted or p.dtype).itemsize
            for _, p in pushed_parameters(self._learner().policy)
        )

    def policy_probe(self, probe: Probe) -> float:
        """The policy's probe log-prob; every rank is called (a collective under FSDP)."""
        return self._learner().probe(*_probe_ids(probe))

    def policy_state(self) -> dict[str, torch.Tensor] | None:
        """The policy's parameters, whole, on the host: rank 0's (every rank is called, a
        collective under FSDP); the others None."""
        from rlx.trainer.learn.sharding import full_state_dict

        state = full_state_dict(self._learner().policy)
        return state if self.spec.rank == 0 else None

    def open_weight_group(self, address: GroupAddress) -> None:
        """Rank 0: open the weight group to the split engines (returns once every engine
        process has joined)."""
        self._sender = WeightSender(WeightGroup.join(address, 0, self.device), self.device)

    def weight_layouts(self, dtype: str | None, bucket_bytes: int) -> list[BucketLayout]:
        """The policy's parameters in buckets of at most bucket_bytes in the engines' dtype
        (when given): the push's layouts, the same on every rank."""
        from rlx.trainer.learn.sharding import push_layouts

        wanted = None if dtype in (None, "auto") else dtype_named(dtype)
        return push_layouts(self._learner().policy, wanted, bucket_bytes)

    def push_weights(self, layouts: list[BucketLayout], queued: bool) -> Traffic:
        """Send the policy's weights to every split engine over the weight group, bucket by
        bucket (weights.WeightSender). Every rank is called: under FSDP each sends its rows
        of every tensor straight into rank 0's bucket buffer, and rank 0 broadcasts each
        filled buffer to the engines. queued (rollouts under way on the engines): rank 0
        sends from a thread of its own and the learners go on; finish_weight_send waits for
        it. Returns what this rank moved."""
        from rlx.trainer.learn.sharding import fill_bucket

        learner = self._learner()
        if self.spec.rank != 0:
            traffic = Traffic()
            if learner.strategy == "fsdp":
                for layout in layouts:
                    traffic.add(fill_bucket(learner.policy, layout, None, self.device))
            return traffic
        if self._sender is None:
            raise RuntimeError("push_weights before open_weight_group")

        def fill(layout: BucketLayout, buffer: torch.Tensor) -> Traffic:
            return fill_bucket(learner.policy, layout, buffer, self.device)

        return self._sender.send(layouts, fill, queued)

    def finish_weight_send(self) -> None:
        """Rank 0: wait for a queued push's sending thread; raises what it raised."""
        if self._sender is not None:
            self._sender.finish()

    # ------------------------------------------------------------------ state

    def rng_state(self) -> dict[str, Any]:
        return capture_rng_state(cuda=self.device.type == "cuda")

    def host_memory(self) -> tuple[str, int, int]:
        """(node IP, pid, resident bytes) of this worker process."""
        return _node_ip(), os.getpid(), procfs.rss_bytes()

    def memory_peak(self, reset: bool = False) -> int:
        return memory_peak(reset)

    def save_checkpoint(self, request: SaveRequest) -> SavedCheckpoint | None:
        """Write this rank's share of the save through the manager it is handed (every rank,
        together; base.CheckpointBase.save_rank). Rank 0 returns the complete checkpoint,
        the other ranks None. Where the manager saves in the background (an upload into
        object storage), every rank returns None once its share is written;
        finish_checkpoint waits for the rest."""
        self.finish_checkpoint()  # one save in flight at most (the controller waits first)
        learner = self._learner()
        manager = request.manager
        save = manager.save_rank(
            request,
            self.spec.rank,
            self.spec.world_size,
            learner_state=learner.sharded_state,
            learner_parts=learner.state_parts,
            dtype=dtype_name(learner.dtype),
            model_folder=Path(self.spec.policy_path),
        )
        if manager.background:
            self._pending_save = save
            return None
        return save.result()

    def finish_checkpoint(self) -> SavedCheckpoint | None:
        """Wait for the save whose upload is under way, if any: rank 0 returns the complete
        checkpoint, the other ranks None. Raises what the upload raised."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.result()

    def load_checkpoint(self, manager: Checkpoints, location: Location) -> LoadReport:
        """Load this rank's share of the checkpoint at location, read through manager."""
        parts = manager.load_parts(location, (LEARNER_STATE, *LEARNER_PARTS, WORKER_RNG))
        if LEARNER_STATE not in parts:
            raise ValueError(
                f"{location} is a single-file checkpoint of an older rlx; resume it with that "
                "version, or train anew"
            )
        learner = self._learner()
        before = procfs.rss_bytes()
        peak_reset = procfs.reset_peak_rss()
        state = learner.sharded_state()
        load_learner_state(state, parts[LEARNER_STATE], manager.shard_reader(parts[LEARNER_STATE]))
        learner.load_sharded_state(state)
        del state
        peak = procfs.peak_rss_bytes() if peak_reset else procfs.rss_bytes()
        learner.load_parts(parts)
        states = parts.get(WORKER_RNG, {}).get("workers", [])
        restored = len(states) == self.spec.world_size
        if restored:
            restore_rng_state(states[self.spec.rank], cuda=self.device.type == "cuda")
        return LoadReport(rng_restored=restored, host_bytes=max(peak - before, 0))

    def close(self) -> None:
        """Before Cluster.shutdown kills this actor."""
        if self.engine is not None and not self.engine.shares_policy:
            self.engine.engine.close_before_exit()
        if self.spec.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class RolloutWorker:
    """A rollout engine of its own (layout: split), loaded from the policy's starting point
    and kept current by weight pushes."""

    def __init__(self, spec: WorkerSpec, index: int, tensor_parallel: int):
        self.index = index
        self.device = _prepare_process(spec, f"rollout-worker-{index}", holds_engine=True)
        self.spec = spec = on_this_node(spec)
        self.engine: RolloutEngine = engine_for_job(
            spec.engine_kind,
            spec.settings,
            spec.policy_path,
            dtype=spec.engine_dtype,
            device=str(self.device),
            use_gpu=spec.use_gpu,
            tensor_parallel=tensor_parallel,
            join_ray=prepare_ray_executor,
        )
        settle(started=True)
        self._skip_pushes = 0
        self._drop_buckets = 0

    def node_ip(self) -> str:
        return _node_ip()

    def notes(self) -> list[str]:
        """What the engine said at start-up, for the run's log."""
        return self.engine.notes()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int) -> Any:
        return _generate(self.engine, prompt_ids, sampling, seed)

    def weight_receivers(self) -> int:
        """The ranks this engine takes in the weight group (its processes holding weights)."""
        return self.engine.weight_receivers

    def join_weight_group(self, address: GroupAddress, first_rank: int) -> None:
        self.engine.join_weight_group(address, first_rank)

    def receive_push(self, layouts: list[BucketLayout], version: int, probe: Probe) -> EngineReport:
        """A whole push from training rank 0 over the weight group, in one call (Ray runs
        this actor's calls in order, so it lands after the rollouts handed out before it: at
        a request boundary). With every tensor received the engine takes the new version;
        the report says what arrived (the controller stops the run on a partial push)."""
        skip = self._skip_pushes > 0
        self._skip_pushes -= int(skip)
        drop, self._drop_buckets = min(self._drop_buckets, len(layouts)), 0
        loaded = self.engine.receive_weights(layouts, version, drop=drop, skip=skip)
        if skip:
            return self.report(probe)
        expected = sum(len(layout.names) for layout in layouts)
        return dataclasses.replace(self.report(probe), received=(loaded, expected))

    def load_weights(
        self, weights: dict[str, torch.Tensor], version: int, probe: Probe
    ) -> EngineReport:
        """A whole push in one call (tests: load given weights under a given version)."""
        self.engine.load_weights(weights, version)
        return self.report(probe)

    def report(self, probe: Probe) -> EngineReport:
        """The weight version this engine holds and its probe log-prob."""
        with torch.inference_mode():
            value = self.engine.logprob_probe(probe.prompt_ids, probe.response_ids)
        return EngineReport(self.index, _node_ip(), self.engine.weight_version, value)

    def skip_next_pushes(self, count: int = 1) -> None:
        """Test hook: ignore the next `count` weight pushes, as a broken transport would."""
        self._skip_pushes = count

    def drop_next_buckets(self, count: int = 1) -> None:
        """Test hook: lose the next `count` buckets of a push (a partial push)."""
        self._drop_buckets = count

    def host_memory(self) -> tuple[str, int, int]:
        return _node_ip(), os.getpid(), procfs.rss_bytes()

    def memory_peak(self, reset: bool = False) -> int:
        return memory_peak(reset)

    def close(self) -> None:
        """Before Cluster.shutdown kills this actor."""
        self.engine.close_before_exit()
