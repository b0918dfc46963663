"""The controller's view of the job's actors: it places and starts them, forms the DDP group,
calls them in parallel, and runs the rollout engines (generate, push weights, verify).

Every Ray call goes through `gather`, which turns a failure inside an actor into one line: an
RlxError raised there keeps its message, a dead actor names its kind, rank and node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlx.errors import RlxError
from rlx.plan.actors import ActorPlan, tensor_parallel_bundles, training_groups
from rlx.plan.strategy import StrategyChoice
from rlx.recipe.model import RolloutSettings
from rlx.trainer import packing
from rlx.trainer.actors.placement import NodeView, reserve, rollout_actor_options, thread_override
from rlx.trainer.actors.workers import (
    RolloutWorker,
    TrainWorker,
    UpdateOutcome,
    WorkerSpec,
    merge_gpu_memory,
)
from rlx.trainer.batch import RolloutBatch, SequenceBatch, concat_rollouts, split_evenly
from rlx.trainer.job import TrainJob
from rlx.trainer.learn.learner import merge_update_stats
from rlx.trainer.report.progress import Progress
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.probe import EngineReport, Probe, check_engines
from rlx.trainer.seeding import derive_seed
from rlx.trainer.stall import StallClock, Stalled

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def gather(
    refs: Sequence[Any],
    what: str,
    *,
    clock: StallClock | None = None,
    labels: Sequence[str] | None = None,
) -> list[Any]:
    """ray.get, with failures as one-line RlxErrors (see the module docstring).

    Results are taken as they come, so the first failure is raised at once: the ranks still
    alive may be blocked in a collective with the one that died (gloo waits for its peer up
    to the process group's timeout), and waiting for all of them would hang the run.

    clock: wait no longer than its window's remaining time, then raise its Stalled naming
    the calls that did not answer (labels, one per ref: "training rank 1 on 10.0.0.2")."""
    import ray

    try:
        wait_for(refs, what, clock, labels)
        return ray.get(list(refs))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RlxError):  # as it is: its kind and exit code go with it
            raise cause.with_traceback(None) from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise RlxError(f"a {what} {_actor_failure(exc)}") from None
    except ray.exceptions.OutOfMemoryError as exc:
        first = ANSI_ESCAPE.sub("", str(exc)).strip().splitlines()[0]
        raise RlxError(
            f"a {what} was killed by Ray's memory monitor: {first}; the run stops here, "
            "resume it from its last checkpoint on nodes with more memory (rlx plan counts "
            "each node's)"
        ) from None


def wait_for(
    refs: Sequence[Any],
    what: str,
    clock: StallClock | None,
    labels: Sequence[str] | None = None,
    progress: Any = None,
) -> None:
    """Every ref done, the first failure raised as it comes (ray.get), within the clock's
    window; progress.update(ref) as each is done, when given."""
    import ray

    pending = list(refs)
    while pending:
        timeout = None if clock is None else clock.remaining()
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            assert clock is not None
            names = list(labels) if labels is not None else []
            names += [f"{what} call {i}" for i in range(len(names), len(refs))]
            label = dict(zip(refs, names, strict=True))
            raise clock.overdue([label[ref] for ref in pending])
        ray.get(ready)  # raises now if that call failed
        if progress is not None:
            progress(ready[0])


def _actor_failure(exc: Exception) -> str:
    """One line on why an actor is gone: the error of a failed start, else Ray's reason."""
    text = ANSI_ESCAPE.sub("", getattr(exc, "error_msg", "") or str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if getattr(exc, "_actor_init_failed", False) and lines:
        last = lines[-1].removeprefix("rlx.errors.RlxError: ")
        return f"failed to start: {last}"
    first = lines[0] if lines else type(exc).__name__
    return (
        f"died ({first}); the run stops here, resume it from its last checkpoint (see the "
        "Ray logs of that node for why it died)"
    )


@dataclass(frozen=True)
class WorkerSet:
    handles: list[Any]
    ips: list[str]


@dataclass(frozen=True)
class StepUpdate:
    """A step's update as the controller sees it: merged metrics, the largest probe
    difference of the engines, and the seconds the ranks spent in the forwards they prepared
    and in bringing the engines up to date (already included in the update call's time)."""

    metrics: dict[str, float]
    probe_diff: float | None  # None: no push was proven in this step (one is still queued)
    prepare_seconds: float
    sync_seconds: float
    notes: tuple[str, ...] = ()  # lines for the run's log (packing turned off on its check)


class Cluster:
    """Training workers (ranks 0..N-1) and, in layout: split, rollout workers."""

    def __init__(
        self,
        job: TrainJob,
        train: WorkerSet,
        rollout: WorkerSet,
        groups: list[Any],
        strategy: StrategyChoice,
    ):
        self.job = job
        self.strategy = strategy  # how the training ranks share the models, and why
        self.settings = job.settings
        self.plan = job.actors
        self.train = train
        self.rollout = rollout
        self._groups = groups
        self.engine_dtype = job.engine_dtype
        self.bucket_bytes = self.settings.rollout.weight_sync_bucket_mb * 2**20
        self.sampling = SamplingArgs.from_settings(self.settings)
        self._queued: QueuedPush | None = None  # a push the engines take after their rollouts
        self._layouts: dict[int, list[Any]] = {}  # a push's bucket layouts, by bucket bytes
        self._push_bytes: int | None = None
        # Held while calls are handed to the engines: a generate from a thread that plays
        # episodes ahead (max_staleness > 0) never lands between the calls of a push.
        self._engine_calls = threading.RLock()
        self.notes: list[str] = []  # what the workers said at start-up, for the run's log
        # Packed passes: b/a of a sequence's cost a*L + b*L^2, to balance the ranks' shares.
        self.attention_weight: float | None = None
        self.last_tolerance = 0.0  # the probe tolerance of the last check
        # The trainer's stall watchdog: every wait on the actors ends with its window.
        self.clock: StallClock | None = None
        self.unanswered: set[Any] = set()  # actors a stall found not answering

    def _gather(self, refs: Sequence[Any], what: str) -> list[Any]:
        """gather within the clock's window, the calls named by the actors they went to."""
        try:
            return gather(refs, what, clock=self.clock, labels=self.labels(what, len(refs)))
        except Stalled:
            self.note_unanswered(refs, self._handles_of(what, len(refs)))
            raise

    def note_unanswered(self, refs: Sequence[Any], handles: Sequence[Any]) -> None:
        """The actors (handles, one per ref) whose call is still not done: shutdown kills
        them without asking them to close (the request would wait behind the call)."""
        import ray

        if len(handles) != len(refs):
            return
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        self.unanswered.update(h for h, ref in zip(handles, refs, strict=True) if ref in pending)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The stall clock's phase while the head waits here (nothing without a clock)."""
        return contextlib.nullcontext() if self.clock is None else self.clock.phase_of(name)

    def _handles_of(self, what: str, count: int) -> list[Any]:
        if what == "training worker" and count <= len(self.train.handles):
            return self.train.handles[:count]
        if what == "rollout worker" and count <= len(self.rollout.handles):
            return self.rollout.handles[:count]
        if what == "worker":
            return (self.train.handles + self.rollout.handles)[:count]
        return []

    def labels(self, what: str, count: int) -> list[str] | None:
        """The actors `count` calls made in order to the workers `what` names went to
        (every caller here calls rank 0 first, then 1, ...): "training rank 1 on 10.0.0.2"."""
        train = [f"training rank {r} on {ip}" for r, ip in enumerate(self.train.ips)]
        engines = [f"rollout worker {i} on {ip}" for i, ip in enumerate(self.rollout.ips)]
        if what == "training worker" and count <= len(train):
            return train[:count]
        if what == "rollout worker" and count <= len(engines):
            return engines[:count]
        if what == "worker" and count <= len(train) + len(engines):
            return (train + engines)[:count]
        return None

    # ------------------------------------------------------------------ start and stop

    @classmethod
    def start(
        cls,
        job: TrainJob,
        nodes: Sequence[NodeView],
        policy_path: str,
        critic_path: str | None,
        strategy: StrategyChoice,
    ) -> Cluster:
        import ray

        settings = job.settings
        plan = job.actors
        groups: list[Any] = []
        try:
            # Training ranks first, on whole nodes: on GPUs each node's worth of ranks is a
            # group of its own packed on one node (STRICT_PACK), so a node's ranks share its
            # NVLink and no FSDP collective crosses nodes that need not; on CPU one rank per
            # node. Then each tensor-parallel engine, a group of one-GPU bundles on one node,
            # on the nodes left; then the one-GPU (or CPU) engines.
            train_slots, train_ips = _reserve_training(plan, nodes, groups)
            rollout_slots, rollout_ips = _reserve_rollout(plan, nodes, groups)
            everyone = train_ips + rollout_ips
            base = WorkerSpec(
                settings=settings,
                policy_path=policy_path,
                critic_path=critic_path,
                rank=0,
                world_size=plan.train_workers,
                node_share=1,
                num_threads=thread_override(),
                engine_kind=job.engine,
                engine_dtype=job.engine_dtype,
                ahead=job.ahead,
                colocated=settings.layout == "colocated",
                use_gpu=job.on_gpus,
                strategy=strategy.strategy,
            )
            train = _start_training_workers(base, plan, train_slots, train_ips, everyone)
            rollout = _start_rollout_workers(
                base, plan, rollout_slots, rollout_ips, everyone, settings.rollout
            )
            cluster = cls(job, train, rollout, groups, strategy)
            cluster._setup_training()
            return cluster
        except BaseException:
            for group in groups:
                ray.util.remove_placement_group(group)
            raise

    def _setup_training(self) -> None:
        train = self.train.handles
        master_addr = self.train.ips[0]
        master_port = self._gather([train[0].free_port.remote()], "training worker")[0]
        reports = self._gather(
            [w.setup.remote(master_addr, master_port) for w in train], "training worker"
        )
        # every rank says the same: once is enough
        self.notes, self.attention_weight = reports[0]
        if self.rollout.handles:  # the engines load at construction; wait for them here
            said = self._gather([r.notes.remote() for r in self.rollout.handles], "rollout worker")
            self.notes = [*self.notes, *said[0]]  # every engine says the same: once is enough
            self._open_weight_group()

    def _open_weight_group(self) -> None:
        """The weight group of split engines: training rank 0 (its rank 0, hosting the
        rendezvous) and every process that holds an engine's weights, in engine order."""
        from rlx.trainer.stall import process_group_timeout
        from rlx.trainer.weights import GroupAddress

        engines = self.rollout.handles
        receivers = self._gather([r.weight_receivers.remote() for r in engines], "rollout worker")
        port = self._gather([self.train.handles[0].free_port.remote()], "training worker")[0]
        address = GroupAddress(
            self.train.ips[0],
            port,
            1 + sum(receivers),
            process_group_timeout(self.settings.stall_timeout),
        )
        firsts = [1 + sum(receivers[:index]) for index in range(len(engines))]
        self._gather(
            [self.train.handles[0].open_weight_group.remote(address)]
            + [
                r.join_weight_group.remote(address, f) for r, f in zip(engines, firsts, strict=True)
            ],
            "worker",
        )

    def shutdown(self) -> None:
        """Every actor asked to close (all at once, 30 s for them all), then killed; those a
        stall found not answering are killed at once."""
        import ray

        handles = self.train.handles + self.rollout.handles
        closes = []
        for handle in handles:
            if handle not in self.unanswered:
                with contextlib.suppress(Exception):
                    closes.append(handle.close.remote())
        with contextlib.suppress(Exception):  # a dead or stuck actor is killed below
            ray.wait(closes, num_returns=len(closes), timeout=30)
        for handle in handles:
            ray.kill(handle)
        for group in self._groups:
            ray.util.remove_placement_group(group)
        self._groups = []

    # ------------------------------------------------------------------ training calls

    def share_rows(self, batch: SequenceBatch) -> list[list[int]]:
        """Rank r's rows of the batch: as many as every other rank's (give or take one).
        Packed: about the same cost too (rlx.trainer.packing.balanced_split), so that no
        rank waits for another; otherwise the r-th of N consecutive slices."""
        ranks = self.plan.train_workers
        if self.attention_weight is None or ranks == 1:
            return [list(rows) for rows in split_evenly(len(batch), ranks)]
        weight = self.attention_weight
        costs = [packing.sequence_cost(n, weight) for n in packing.sequence_lengths(batch)]
        return packing.balanced_split(costs, ranks)

    def shard(self, batch: SequenceBatch) -> list[SequenceBatch]:
        return [batch.select(rows) for rows in self.share_rows(batch)]

    def prepare(self, batch: SequenceBatch, old_logprobs: bool) -> dict[str, Any]:
        """Reference log-probs, values, old log-probs of the whole batch, (B, R) each."""
        import torch

        shares = self.share_rows(batch)
        outs = self._gather(
            [
                w.prepare.remote(batch.select(rows), old_logprobs)
                for w, rows in zip(self.train.handles, shares, strict=True)
            ],
            "training worker",
        )
        order = torch.tensor([row for rows in shares for row in rows])
        back = torch.argsort(order)  # the ranks' rows, concatenated, back in batch order
        return {name: torch.cat([out[name] for out in outs])[back] for name in outs[0]}

    def update(self, batch: SequenceBatch, step: int, *, prepare: bool, probe: Probe) -> StepUpdate:
        """The step's update on every rank, then every engine brought to the new weights
        (version `step`) and checked. prepare: the ranks first compute the reference and old
        log-probs themselves. Colocated engines are refreshed within the same call, so a step
        costs the workers two calls (generate, update) however much it does."""
        colocated = not self.rollout.handles
        shards = self.shard(batch)
        outcomes: list[UpdateOutcome] = self._gather(
            [
                w.update.remote(shard, step, prepare, probe if colocated else None)
                for w, shard in zip(self.train.handles, shards, strict=True)
            ],
            "training worker",
        )
        metrics = merge_update_stats([outcome.stats for outcome in outcomes])
        notes = tuple(outcomes[0].stats.notes)  # every rank decides alike
        metrics.update(merge_gpu_memory([outcome.gpu for outcome in outcomes]))
        prepare_seconds = max(outcome.prepare_seconds for outcome in outcomes)
        if not colocated:
            started = time.perf_counter()
            with self.phase("weight push"):
                if self.job.ahead:
                    probe_diff = self.queue_weights(step, probe)
                else:
                    probe_diff = self.sync_weights(step, probe)
            seconds = time.perf_counter() - started
            return StepUpdate(metrics, probe_diff, prepare_seconds, seconds, notes)
        refreshed = [outcome.refresh for outcome in outcomes if outcome.refresh is not None]
        if len(refreshed) != len(outcomes):
            raise RuntimeError("a colocated training worker did not refresh its engine")
        probe_diff = self._check_colocated(refreshed, step, probe)
        refresh_seconds = max(outcome.refresh_seconds for outcome in outcomes)
        return StepUpdate(metrics, probe_diff, prepare_seconds, refresh_seconds, notes)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(w, method).remote(*args) for w in self.train.handles]
        return self._gather(refs, "training worker")

    def worker_memory(self) -> list[tuple[str, int, int]]:
        refs = [h.host_memory.remote() for h in self.train.handles + self.rollout.handles]
        return self._gather(refs, "worker")

    # ------------------------------------------------------------------ rollout engines

    @property
    def engines(self) -> list[Any]:
        return self.rollout.handles or self.train.handles

    def generate(
        self,
        prompt_ids: list[list[int]],
        step: int,
        show_progress: bool,
        sampling: SamplingArgs | None = None,
        stream: str = "generate",
    ) -> RolloutBatch:
        """n samples per prompt, prompts split over the engines, results in prompt order.
        sampling: other settings than the rollout's (validation), seeded from `stream`."""
        return self.submit_generate(prompt_ids, step, sampling, stream).collect(show_progress)

    def submit_generate(
        self,
        prompt_ids: list[list[int]],
        step: int,
        sampling: SamplingArgs | None = None,
        stream: str = "generate",
    ) -> PendingRollout:
        """Start `generate` and return at once. Each engine runs its calls in the order they
        were made, so a weight push made after this call reaches an engine only once it has
        finished these samples (the push waits for the request boundary)."""
        with self._engine_calls:
            return self._submit_generate(prompt_ids, step, sampling or self.sampling, stream)

    def _submit_generate(
        self, prompt_ids: list[list[int]], step: int, sampling: SamplingArgs, stream: str
    ) -> PendingRollout:
        engines = self.engines
        ranges = split_evenly(len(prompt_ids), len(engines))
        refs = {}
        idle = []
        for index, (engine, rows) in enumerate(zip(engines, ranges, strict=True)):
            if len(rows):
                seed = derive_seed(self.settings.seed, stream, step, index)
                chunk = [prompt_ids[i] for i in rows]
                refs[index] = engine.generate.remote(chunk, sampling, seed)
            elif not self.rollout.handles:
                # A training worker without prompts still takes part: a sharded policy's
                # forwards are collectives of every rank.
                idle.append(engine.generate.remote([], sampling, 0))
        what = "rollout worker" if self.rollout.handles else "training worker"
        rows_of = {index: len(ranges[index]) * sampling.n for index in refs}
        names = self.labels(what, len(engines)) or [f"{what} {i}" for i in range(len(engines))]
        return PendingRollout(refs, rows_of, idle, what, self, names)

    def sync_weights(self, version: int, probe: Probe, *, push: bool = True) -> float:
        """Bring every engine to the policy's weights `version` and prove it; returns the
        largest probe difference. Raises StaleEngineError on any engine that is behind.
        push=False only checks (split engines fresh from the policy's own starting point)."""
        train = self.train.handles
        if not self.rollout.handles:
            results = self._gather(
                [w.refresh_engine.remote(version, probe) for w in train], "training worker"
            )
            return self._check_colocated(results, version, probe)
        # Every rank scores (a collective under FSDP); rank 0's value is used.
        policy_refs = [w.policy_probe.remote(probe) for w in train]
        if push:
            with self._engine_calls:
                sends, receives = self._push(version, probe, queued=False)
            self._gather(sends, "training worker")
        else:
            receives = [r.report.remote(probe) for r in self.rollout.handles]
        reports = self._gather(receives, "rollout worker")
        policy_logprob = self._gather(policy_refs, "training worker")[0]
        return self._check(reports, version, policy_logprob, probe)

    def queue_weights(self, version: int, probe: Probe) -> float | None:
        """Split engines with rollouts under way (max_staleness > 0): hand them the push of
        `version` without waiting. The training ranks gather it into rank 0's buckets now
        (their next update is queued behind these calls, so the buckets hold exactly this
        version) and a thread of rank 0 sends them as each engine takes them, after the
        rollouts it was given earlier: at a request boundary, never in the middle of one.
        Meanwhile the learners go on. The push is proven like any other (version + probe,
        check_engines) before the next one is queued, or at the run's end (finish_pushes).
        Returns the largest probe difference of the push checked now (the previous one),
        None when there was none.

        Cost: one copy of the weights (in the engines' dtype) on rank 0's host until the
        engines take it."""
        checked = self.finish_pushes()
        policy_refs = [w.policy_probe.remote(probe) for w in self.train.handles]
        with self._engine_calls:  # the push lands at the same point of every engine's calls
            sends, receives = self._push(version, probe, queued=True)
        self._queued = QueuedPush(version, policy_refs, sends, receives, probe)
        return checked

    def finish_pushes(self) -> float | None:
        """Wait for the queued push (if any) to land on every engine and prove it: the
        check sync_weights makes, for a push made earlier. None when none was queued."""
        queued, self._queued = self._queued, None
        if queued is None:
            return None
        self._gather(queued.sends, "training worker")
        self._gather([self.train.handles[0].finish_weight_send.remote()], "training worker")
        reports = self._gather(queued.receives, "rollout worker")
        policy_logprob = self._gather(queued.policy_refs, "training worker")[0]
        return self._check(reports, queued.version, policy_logprob, queued.probe)

    def _check(
        self, reports: Sequence[EngineReport], version: int, policy_logprob: float, probe: Probe
    ) -> float:
        """check_engines with the probe's tolerance for the engines' dtype, kept for the log
        (last_tolerance)."""
        self.last_tolerance = probe.tolerance(self.engine_dtype, policy_logprob)
        return check_engines(reports, version, policy_logprob, self.last_tolerance)

    def push_layouts(self) -> list[Any]:
        """The push's bucket layouts in the engines' dtype (the same every push, for a
        given bucket size: the parameters' shapes do not change)."""
        layouts = self._layouts.get(self.bucket_bytes)
        if layouts is None:
            layouts = self._gather(
                [self.train.handles[0].weight_layouts.remote(self.engine_dtype, self.bucket_bytes)],
                "training worker",
            )[0]
            self._layouts[self.bucket_bytes] = layouts
        return layouts

    def push_bytes(self) -> int:
        """Bytes one push hands each engine: the pushed tensors (with LoRA the adapters
        alone) in the engines' dtype; 0 where the engine runs the policy's own module."""
        if self._push_bytes is None:
            if self.rollout.handles:
                self._push_bytes = sum(layout.nbytes for layout in self.push_layouts())
            else:
                worker = self.train.handles[0]
                self._push_bytes = self._gather(
                    [worker.push_bytes.remote(self.engine_dtype)], "training worker"
                )[0]
        return self._push_bytes

    def _push(self, version: int, probe: Probe, *, queued: bool) -> tuple[list[Any], list[Any]]:
        """Start a push of `version` over the weight group: every training rank sends (rank
        0 broadcasts), every engine receives the whole push in one call and reports."""
        layouts = self.push_layouts()
        sends = [w.push_weights.remote(layouts, queued) for w in self.train.handles]
        receives = [r.receive_push.remote(layouts, version, probe) for r in self.rollout.handles]
        return sends, receives

    def _check_colocated(
        self, refreshed: Sequence[tuple[EngineReport, float]], version: int, probe: Probe
    ) -> float:
        """check_engines over what each training worker's refresh_engine returned (its
        engine's report, its policy's probe log-prob), against rank 0's policy."""
        reports = [report for report, _ in refreshed]
        policy_logprob = refreshed[0][1]
        return self._check(reports, version, policy_logprob, probe)


@dataclass(frozen=True)
class QueuedPush:
    """A weight push handed to the engines without waiting (Cluster.queue_weights)."""

    version: int
    policy_refs: list[Any]  # every rank's policy probe, taken right after the update
    sends: list[Any]  # the training ranks' push_weights calls (rank 0: staged, sending)
    receives: list[Any]  # the engines' receive_push reports
    probe: Probe


@dataclass
class PendingRollout:
    """A generate call under way on the engines (Cluster.submit_generate)."""

    refs: dict[int, Any]  # engine index -> its call
    rows_of: dict[int, int]  # engine index -> samples it makes
    idle: list[Any]  # calls of training workers without prompts (colocated, sharded)
    what: str
    cluster: Cluster | None = None  # its stall clock bounds the wait, when it has one
    names: list[str] | None = None  # engine index -> the actor, for a stall's line

    def collect(self, show_progress: bool = False) -> RolloutBatch:
        """Wait for every engine's samples; the batch in prompt order."""
        import ray

        order = sorted(self.refs)
        refs = [self.refs[i] for i in order]
        clock = None if self.cluster is None else self.cluster.clock
        names = self.names or [f"{self.what} {i}" for i in range(max(order, default=-1) + 1)]
        index_of = {ref: index for index, ref in self.refs.items()}
        with _maybe_progress(show_progress, sum(self.rows_of.values()), "rollout") as progress:

            def done(ref: Any) -> None:
                progress.update(self.rows_of[index_of[ref]])

            with contextlib.ExitStack() as stack:
                if self.cluster is not None:
                    stack.enter_context(self.cluster.phase("generation"))
                try:
                    wait_for(refs, self.what, clock, [names[i] for i in order], done)
                    wait_for(self.idle, self.what, clock)
                except Stalled:
                    if self.cluster is not None:
                        handles = self.cluster.engines
                        self.cluster.note_unanswered(refs, [handles[i] for i in order])
                    raise
                except ray.exceptions.RayError:
                    pass  # gather below makes the line
        batches = gather(refs, self.what)
        gather(self.idle, self.what)
        return concat_rollouts(batches)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _maybe_progress(show: bool, total: int, desc: str) -> Progress | _NoProgress:
    # A bar per step is useful on a terminal; in a log file it would be noise every step.
    if show and sys.stderr.isatty():
        return Progress(total, desc, stream=sys.stderr)
    return _NoProgress()


Slot = tuple[Any, int]  # (placement group, bundle index) of one actor


def _reserve_training(
    plan: ActorPlan, nodes: Sequence[NodeView], groups: list[Any]
) -> tuple[list[Slot], list[str]]:
    """The training ranks' slots and node IPs, a group per training node (or one group
    spread over the nodes); each group made is added to `groups`."""
    slots: list[Slot] = []
    ips: list[str] = []
    for index, count in enumerate(training_groups(plan)):
        group, group_ips = reserve(
            count,
            plan.train_gpus,
            "STRICT_SPREAD" if plan.spread_training else "STRICT_PACK",
            "training workers" if plan.spread_training else f"training node {index}",
            nodes,
            node_group=plan.train_group,
        )
        groups.append(group)
        slots += [(group, bundle) for bundle in range(count)]
        ips += group_ips
    return slots, ips


def _reserve_rollout(
    plan: ActorPlan, nodes: Sequence[NodeView], groups: list[Any]
) -> tuple[list[Slot], list[str]]:
    """The rollout workers' slots and node IPs: a group of one-GPU bundles on one node for
    each tensor-parallel engine, else one group for them all; each added to `groups`."""
    slots: list[Slot] = []
    ips: list[str] = []
    if plan.rollout_workers and plan.rollout_gpus > 1:
        for index in range(plan.rollout_workers):
            group, group_ips = reserve(
                1,
                1,
                "STRICT_PACK",
                f"tensor-parallel rollout engine {index}",
                nodes,
                bundles=tensor_parallel_bundles(plan.rollout_gpus),
                node_group=plan.rollout_group,
            )
            groups.append(group)
            slots.append((group, 0))
            ips.append(group_ips[0])
    if plan.rollout_workers and plan.rollout_gpus <= 1:
        group, ips = reserve(
            plan.rollout_workers,
            plan.rollout_gpus,
            "STRICT_SPREAD" if plan.spread_rollout else "PACK",
            "rollout workers",
            nodes,
            node_group=plan.rollout_group,
        )
        groups.append(group)
        slots = [(group, i) for i in range(plan.rollout_workers)]
    return slots, ips


def _start_training_workers(
    base: WorkerSpec, plan: ActorPlan, slots: list[Slot], ips: list[str], everyone: list[str]
) -> WorkerSet:
    """A TrainWorker in each training slot, ranked: rank 0 on this (the head) node when it
    trains, where the checkpoint is written from; then node by node, so the ranks of one
    node are neighbours."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    here = ray.util.get_node_ip_address()
    order = sorted(range(len(ips)), key=lambda i: (ips[i] != here, everyone.index(ips[i]), i))
    handles = []
    for rank, slot in enumerate(order):
        spec = dataclasses.replace(base, rank=rank, node_share=everyone.count(ips[slot]))
        group, bundle = slots[slot]
        actor = ray.remote(TrainWorker).options(
            num_cpus=1,
            num_gpus=plan.train_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle
            ),
            name=None,
        )
        handles.append(actor.remote(spec))
    return WorkerSet(handles, [ips[slot] for slot in order])


def _start_rollout_workers(
    base: WorkerSpec,
    plan: ActorPlan,
    slots: list[Slot],
    ips: list[str],
    everyone: list[str],
    rollout: RolloutSettings,
) -> WorkerSet:
    """A RolloutWorker in each rollout slot (layout: split; none colocated)."""
    import ray

    handles = []
    for index, ((group, bundle), ip) in enumerate(zip(slots, ips, strict=True)):
        spec = dataclasses.replace(base, rank=index, node_share=everyone.count(ip))
        actor = ray.remote(RolloutWorker).options(
            **rollout_actor_options(plan.rollout_gpus, group, bundle)
        )
        handles.append(actor.remote(spec, index, rollout.tensor_parallel_size))
    return WorkerSet(handles, ips)
