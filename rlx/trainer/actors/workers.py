"""The Ray actors: training workers (one per GPU, or one per node on CPU) and rollout workers
(layout: split). Plain classes, wrapped with ray.remote where they are placed (cluster.py);
each method moves tensors in and out and calls the Learner or an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlx import procfs
from rlx.recipe.model import TrainerSettings
from rlx.storage import is_store_url
from rlx.trainer.actors.placement import threads_for
from rlx.trainer.batch import RolloutBatch, SequenceBatch
from rlx.trainer.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    read_marker,
    restore_rng_state,
)
from rlx.trainer.checkpoint.remote import (
    DCP_METADATA,
    Background,
    StoreCheckpointManager,
    remove,
    staging_root,
)
from rlx.trainer.checkpoint.training import (
    EXPORT_INFO,
    HF_FILES,
    LEARNER_PARTS,
    LEARNER_STATE,
    WORKER_RNG,
    LoadReport,
    SavedCheckpoint,
    SaveRequest,
    copy_model_files,
    kill_hook_for_save,
    load_learner_state,
    load_parts,
    model_files_folder,
    save_learner_state,
)
from rlx.trainer.learn.learner import Learner, UpdateStats, needs_old_logprobs
from rlx.trainer.learn.models import autocast, compute_dtype
from rlx.trainer.rollout import make_engine
from rlx.trainer.rollout.base import RolloutEngine, SamplingArgs
from rlx.trainer.rollout.colocated import ColocatedEngine, make_colocated_engine
from rlx.trainer.rollout.hf import HFEngine
from rlx.trainer.rollout.probe import EngineReport, Probe
from rlx.trainer.seeding import derive_seed
from rlx.trainer.weights import PackedBucket

DIST_TIMEOUT = timedelta(minutes=30)


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
    colocated: bool  # training workers hold the engines
    use_gpu: bool


def on_this_node(spec: WorkerSpec) -> WorkerSpec:
    """spec with its model paths as folders on this worker's node (fetched from a store, or
    a tiny model built here, when the head's copy is not on a shared disk)."""
    from rlx.trainer.resolve import node_model_path

    settings = spec.settings
    policy = node_model_path(spec.policy_path, settings.model.path, settings.seed)
    critic = spec.critic_path
    if critic is not None:
        source = (settings.critic_model or settings.model).path
        critic = node_model_path(critic, source, settings.seed)
    return dataclasses.replace(spec, policy_path=policy, critic_path=critic)


@dataclass
class _Push:
    """A streamed weight push as a rollout worker sees it."""

    version: int
    expected: int
    received: int = 0
    skip: bool = False


@dataclass
class UpdateOutcome:
    """What TrainWorker.update returns: the rank's update numbers, its engine's report and
    policy probe value (colocated), and the seconds spent preparing and refreshing."""

    stats: UpdateStats
    refresh: tuple[EngineReport, float] | None
    prepare_seconds: float
    refresh_seconds: float


def _prepare_process(spec: WorkerSpec, stream: str) -> torch.device:
    from rlx.trainer.learn.models import quiet_transformers

    quiet_transformers()
    # Ray sets OMP_NUM_THREADS=1 in its workers; torch then uses one core unless told.
    torch.set_num_threads(threads_for(spec.node_share, spec.num_threads))
    torch.manual_seed(derive_seed(spec.settings.seed, stream, spec.rank))
    return torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")


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


def _vllm_options(
    settings: TrainerSettings, tensor_parallel: int, model_path: str, use_gpu: bool
) -> dict[str, Any]:
    rollout = settings.rollout
    options: dict[str, Any] = {
        "tensor_parallel_size": tensor_parallel,
        "max_model_len": max_model_len(settings),
        "seed": settings.seed,
        "trust_remote_code": settings.model.trust_remote_code,
    }
    if tensor_parallel > 1:
        # Chosen, not left to vLLM: on GPUs its Ray executor, one worker per GPU bundle of
        # the engine's placement group (exactly the GPUs rlx reserved); on CPU processes.
        options["distributed_executor_backend"] = "ray" if use_gpu else "mp"
    if use_gpu:
        options["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    else:
        # vLLM's CPU build reads gpu_memory_utilization as a share of host RAM; a step's
        # sequences need far less, sized from the model instead. No graph capture on CPU.
        options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(settings, model_path)
        options["enforce_eager"] = True
        if tensor_parallel == 1:
            # One CPU engine runs best in this process: vLLM's default puts its engine core
            # (a busy loop) and its model worker in two more processes that then compete
            # for the same cores. In-process, an engine pinned to one core generated the
            # quickstart's step in 0.24 s instead of 0.37 s, and started in 9 s, not 26 s.
            options["distributed_executor_backend"] = "uni"
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return options


def max_model_len(settings: TrainerSettings) -> int:
    """The longest sequence an engine is asked for: a prompt and the longest response
    (rollout or validation) or the longest episode (prompt, every turn and every
    observation), plus the one token the probe's request generates."""
    from rlx.recipe.model import episode_token_budget

    longest = episode_token_budget(settings)
    validation = settings.validation
    if validation is not None and validation.max_new_tokens is not None:
        longest = max(longest, validation.max_new_tokens)
    return settings.data.max_prompt_length + longest + 1


def prepare_tensor_parallel(tensor_parallel: int, use_gpu: bool) -> None:
    """The environment a tensor-parallel vLLM engine needs in this actor. GPU: its engine
    core runs in a child process that joins this Ray cluster (by RAY_ADDRESS) and finds the
    actor's placement group through vLLM. CPU: each of its worker processes is bound to its
    own cores (VLLM_CPU_OMP_THREADS_BIND, unless set), this actor's cores split evenly."""
    if use_gpu:
        import ray

        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel))


def cpu_binding(tensor_parallel: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel` workers over these cores (this
    process's by default): consecutive, equal shares, "0-3|4-7"; with fewer cores than
    workers, one core each, reused in turn."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    share = max(len(cores) // tensor_parallel, 1)
    groups = []
    for worker in range(tensor_parallel):
        start = (worker * share) % len(cores)
        mine = cores[start : start + share]
        groups.append(",".join(str(core) for core in mine))
    return "|".join(groups)


def cpu_kv_cache_bytes(settings: TrainerSettings, model_path: str) -> int:
    """KV-cache bytes for every sequence of a step at full length, twice over (at least
    64 MiB): keys and values of every layer in float32, per token as `rlx plan` counts them."""
    from transformers import AutoConfig

    from rlx.plan.memory import kv_bytes_per_token
    from rlx.plan.shapes import ModelShape
    from rlx.recipe.model import episode_token_budget

    config = AutoConfig.from_pretrained(
        model_path, trust_remote_code=settings.model.trust_remote_code
    )
    shape = ModelShape.from_config(config.to_dict(), source=model_path)
    per_token = kv_bytes_per_token(shape, dtype="float32")
    rollout = settings.rollout
    tokens = (
        settings.batch.prompts_per_step
        * rollout.n
        * (settings.data.max_prompt_length + episode_token_budget(settings))
    )
    return max(2 * tokens * per_token, 64 * 2**20)


def _probe_ids(probe: Probe) -> tuple[list[int], list[int]]:
    return probe.prompt_ids, probe.response_ids


def _generate(
    engine: RolloutEngine, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int
) -> RolloutBatch:
    # no_grad, not inference_mode: a sharded policy's gathered weights must stay writable.
    with torch.no_grad():
        return engine.generate(
            prompt_ids,
            sampling.n,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=seed,
        )


class TrainWorker:
    """One data-parallel rank: a Learner, and in layout: colocated its rollout engine."""

    def __init__(self, spec: WorkerSpec):
        self.device = _prepare_process(spec, "train-worker")
        self.spec = spec = on_this_node(spec)
        self.learner: Learner | None = None
        self.engine: ColocatedEngine | None = None
        self.model_files: Path | None = None  # config and tokenizer files, for checkpoints
        self._pending_save: Background | None = None  # a store upload still under way
        self._push_plan: list[list[str]] = []  # the open weight push (split engines)
        self._push_dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ set-up

    def node_ip(self) -> str:
        return _node_ip()

    def free_port(self) -> int:
        """A port free on this node now, for the torch.distributed rendezvous (rank 0)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def setup(self, master_addr: str, master_port: int) -> list[str]:
        """Join the process group, build the Learner and (colocated) the engine; returns
        notes for the run's log."""
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
                timeout=DIST_TIMEOUT,
            )
        # A colocated vLLM engine starts before the learner fills the GPU: it sizes its
        # share (gpu_memory_utilization) from memory that is still free. It loads the
        # policy's starting weights from the same files.
        if spec.colocated and spec.engine_kind == "vllm":
            self.engine = self._colocated_engine(None, None, notes)
        self.learner = Learner(
            spec.settings,
            spec.policy_path,
            spec.critic_path,
            self.device,
            rank=spec.rank,
            world_size=spec.world_size,
        )
        if spec.colocated and self.engine is None:
            self.engine = self._colocated_engine(
                self.learner.policy, self.learner.collective, notes
            )
        return notes

    def _colocated_engine(self, policy: Any, collective: Any, notes: list[str]) -> ColocatedEngine:
        spec = self.spec
        return make_colocated_engine(
            spec.engine_kind,
            policy,
            spec.policy_path,
            dtype=dtype_name(compute_dtype(spec.settings.model.dtype, self.device)),
            vllm_options=_vllm_options(spec.settings, 1, spec.policy_path, spec.use_gpu),
            collective=collective,
            say=notes.append,
            bucket_bytes=spec.settings.rollout.weight_sync_bucket_mb * 2**20,
        )

    def _learner(self) -> Learner:
        if self.learner is None:
            raise RuntimeError("setup() was not called")
        return self.learner

    # ------------------------------------------------------------------ the step

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int) -> Any:
        if self.engine is None:
            raise RuntimeError("this worker holds no engine (layout: split)")
        learner = self._learner()
        # HF generate over the float32 master weights on GPU: bf16 compute, as training.
        with autocast(self.device, learner.dtype), learner.no_grad():
            engine = self.engine.engine
            if not prompt_ids:  # a sharded policy: join the other ranks' forwards
                if isinstance(engine, HFEngine):
                    engine.take_part(sampling.max_new_tokens)
                return None
            return _generate(engine, prompt_ids, sampling, seed)

    def prepare(self, batch: SequenceBatch, old_logprobs: bool) -> dict[str, torch.Tensor]:
        if self.engine is not None:
            self.engine.release(self.learner)
        return self._learner().prepare(batch, old_logprobs=old_logprobs)

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
            old_logprobs = needs_old_logprobs(self.spec.settings)
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

    def policy_probe(self, probe: Probe) -> float:
        """The policy's probe log-prob; every rank is called (a collective under FSDP)."""
        return self._learner().probe(*_probe_ids(probe))

    def open_weight_stream(self, dtype: str | None, bucket_bytes: int) -> list[list[str]]:
        """Start a push to split engines: the policy's parameters grouped into buckets of at
        most bucket_bytes in the engines' dtype (when given). Every rank is called and
        returns the same plan; weight_bucket then gives the buckets."""
        from rlx.trainer.learn.sharding import push_plan

        self._push_dtype = None if dtype in (None, "auto") else getattr(torch, dtype)
        self._push_plan = push_plan(self._learner().policy, self._push_dtype, bucket_bytes)
        return self._push_plan

    def tensor_bytes(self, names: list[str]) -> list[int]:
        """Bytes of the named parameters in the open push's dtype (benchmarks)."""
        params = dict(self._learner().policy.named_parameters())
        return [params[n].numel() * (self._push_dtype or params[n].dtype).itemsize for n in names]

    def weight_bucket(self, index: int) -> PackedBucket | None:
        """Bucket `index` of the open push as whole tensors in one host buffer, from rank 0
        (its result travels once through Ray's object store to every engine). Under FSDP
        every rank is called: each tensor is gathered from all of them; the other ranks
        return None."""
        from rlx.trainer.learn.sharding import gather_bucket

        learner = self._learner()
        rank0 = self.spec.rank == 0
        if learner.strategy != "fsdp" and not rank0:
            return None
        names = self._push_plan[index]
        bucket = gather_bucket(learner.policy, names, self._push_dtype, keep=rank0)
        return PackedBucket.pack(bucket) if rank0 else None

    # ------------------------------------------------------------------ state

    def rng_state(self) -> dict[str, Any]:
        return capture_rng_state()

    def host_memory(self) -> tuple[str, int, int]:
        """(node IP, pid, resident bytes) of this worker process."""
        return _node_ip(), os.getpid(), procfs.rss_bytes()

    def memory_peak(self, reset: bool = False) -> int:
        return memory_peak(reset)

    def save_checkpoint(self, request: SaveRequest) -> SavedCheckpoint | None:
        """Write this rank's shard into the save's temporary folder (every rank, together);
        rank 0 then adds the small parts and commits the folder. Rank 0 returns the complete
        checkpoint, the other ranks None. Into object storage, the upload goes on after this
        returns (None from every rank): finish_checkpoint waits for it."""
        if is_store_url(request.root):
            self._start_store_save(request)
            return None
        learner = self._learner()
        temporary = Path(request.folder)
        save_learner_state(learner.sharded_state(), temporary / LEARNER_STATE)
        if self.spec.rank != 0:
            return None
        hook = kill_hook_for_save(request.kill_spec, request.step)
        if hook is not None:
            hook(f"part:{LEARNER_STATE}")
        manager = CheckpointManager(Path(request.root), request.run_id, request.keep)
        entries = manager.write_parts(temporary, self._small_parts(request), hook)
        self._add_model_files(temporary, entries)
        final = manager.commit(temporary, request.step, entries, _after_phase=hook)
        marker = read_marker(final)
        return SavedCheckpoint(str(final), None if marker is None else marker["bytes"])

    def finish_checkpoint(self) -> SavedCheckpoint | None:
        """Wait for the save whose upload is under way, if any: rank 0 returns the complete
        checkpoint, the other ranks None. Raises what the upload raised."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.result()

    def _small_parts(self, request: SaveRequest) -> dict[str, Any]:
        learner = self._learner()
        return {
            **learner.state_parts(),
            **request.controller_parts,
            WORKER_RNG: {"workers": request.rng_states},
            EXPORT_INFO: {"dtype": dtype_name(learner.dtype)},
        }

    def _add_model_files(self, folder: Path, entries: dict[str, dict[str, str]]) -> None:
        if self.model_files is None:
            self.model_files = model_files_folder(self.spec.policy_path)
        copy_model_files(self.model_files, folder / HF_FILES)
        entries[LEARNER_STATE] = {"file": LEARNER_STATE, "format": "dcp"}
        entries[HF_FILES] = {"file": HF_FILES, "format": "folder"}

    def _start_store_save(self, request: SaveRequest) -> None:
        """A save into object storage (remote.py). On the step's path: this rank stages its
        shard on its node's disk (DCP, a collective), rank 0 the small parts too. Then, in a
        thread while training goes on: the rank uploads its shard and its receipt; rank 0
        waits for every receipt, uploads the DCP metadata and the small parts, checks the
        listing and writes COMPLETE."""
        self.finish_checkpoint()  # one save in flight at most (the controller waits first)
        learner = self._learner()
        rank, world_size, step = self.spec.rank, self.spec.world_size, request.step
        # This node's own staging folder (RLX_STAGING_DIR as the node has it), named like
        # the one the controller picked for the save.
        staging = staging_root() / request.run_id / Path(request.folder).name / f"rank-{rank}"
        manager = StoreCheckpointManager(request.root, request.run_id, request.keep)
        hook = kill_hook_for_save(request.kill_spec, step) if rank == 0 else None
        entries: dict[str, dict[str, str]] = {}
        try:
            save_learner_state(learner.sharded_state(), staging / LEARNER_STATE)
            if rank == 0:
                if hook is not None:
                    hook(f"part:{LEARNER_STATE}")
                entries = manager.write_parts(staging, self._small_parts(request), hook)
                self._add_model_files(staging, entries)
        except BaseException:
            _remove_staging(staging)
            raise

        def upload() -> SavedCheckpoint | None:
            try:
                mine = manager.upload(
                    staging / LEARNER_STATE, step, LEARNER_STATE, skip=(DCP_METADATA,)
                )
                manager.report_upload(step, rank, mine)
                if rank != 0:
                    return None
                url = manager.commit(
                    staging,
                    step,
                    entries,
                    manager.wait_for_uploads(step, world_size),
                    late=(f"{LEARNER_STATE}/{DCP_METADATA}",),
                    _after_phase=hook,
                )
                return SavedCheckpoint(url, manager.last_bytes)
            finally:
                _remove_staging(staging)

        self._pending_save = Background(upload)

    def load_checkpoint(self, path: str) -> LoadReport:
        """Load this rank's share of the checkpoint."""
        location = path if is_store_url(path) else Path(path)
        parts = load_parts(location, (LEARNER_STATE, *LEARNER_PARTS, WORKER_RNG))
        if LEARNER_STATE not in parts:
            raise ValueError(
                f"{path} is a single-file checkpoint of an older rlx; resume it with that "
                "version, or train anew"
            )
        learner = self._learner()
        before = procfs.rss_bytes()
        peak_reset = procfs.reset_peak_rss()
        state = learner.sharded_state()
        load_learner_state(state, parts[LEARNER_STATE])
        learner.load_sharded_state(state)
        del state
        peak = procfs.peak_rss_bytes() if peak_reset else procfs.rss_bytes()
        learner.load_parts(parts)
        states = parts.get(WORKER_RNG, {}).get("workers", [])
        restored = len(states) == self.spec.world_size
        if restored:
            restore_rng_state(states[self.spec.rank])
        return LoadReport(rng_restored=restored, host_bytes=max(peak - before, 0))

    def close(self) -> None:
        if self.engine is not None and not self.engine.shares_policy:
            self.engine.engine.close()
        if self.spec.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _remove_staging(staging: Path) -> None:
    remove(staging)
    with contextlib.suppress(OSError):  # the save's folder, once every rank of the node is done
        staging.parent.rmdir()


class RolloutWorker:
    """A rollout engine of its own (layout: split), loaded from the policy's starting point
    and kept current by weight pushes."""

    def __init__(self, spec: WorkerSpec, index: int, tensor_parallel: int):
        self.index = index
        self.device = _prepare_process(spec, f"rollout-worker-{index}")
        self.spec = spec = on_this_node(spec)
        if tensor_parallel > 1 and spec.engine_kind == "vllm":
            prepare_tensor_parallel(tensor_parallel, spec.use_gpu)
        self.engine = make_engine(
            spec.engine_kind,
            spec.policy_path,
            dtype=dtype_name(compute_dtype(spec.settings.model.dtype, self.device)),
            device=str(self.device),
            vllm_options=_vllm_options(
                spec.settings, tensor_parallel, spec.policy_path, spec.use_gpu
            ),
        )
        self._push: _Push | None = None
        self._skip_pushes = 0
        self._drop_buckets = 0

    def node_ip(self) -> str:
        return _node_ip()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingArgs, seed: int) -> Any:
        return _generate(self.engine, prompt_ids, sampling, seed)

    def begin_push(self, version: int, expected: int) -> None:
        """A streamed push of `expected` tensors starts; push_bucket calls follow, then
        finish_push (Ray runs one caller's calls to an actor in order)."""
        skip = self._skip_pushes > 0
        self._skip_pushes -= int(skip)
        self._push = _Push(version, expected, skip=skip)
        if not skip:
            self.engine.begin_weights()

    def push_bucket(self, bucket: PackedBucket) -> int:
        push = self._push
        if push is None:
            raise RuntimeError("push_bucket without begin_push")
        if push.skip:
            return 0
        if self._drop_buckets:
            self._drop_buckets -= 1  # test hook: a bucket lost on the way
            return 0
        taken = self.engine.load_weight_bucket(bucket.tensors())
        push.received += taken
        return taken

    def finish_push(self, probe: Probe) -> EngineReport:
        """The push is over: with every tensor received the engine takes the new version;
        the report says what arrived (the controller stops the run on a partial push)."""
        push, self._push = self._push, None
        if push is None:
            raise RuntimeError("finish_push without begin_push")
        if push.skip:
            return self.report(probe)
        if push.received == push.expected:
            self.engine.finish_weights(push.version)
        return dataclasses.replace(self.report(probe), received=(push.received, push.expected))

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
        self.engine.close()
