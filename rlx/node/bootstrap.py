"""`rlx node`: what every node of a rendered job runs.

Head (rank 0): stop any Ray this job left on the node, start the Ray head and tell the
workers to join as soon as its GCS accepts nodes (while the rest of the head still starts),
wait until every node (and GPU) is ALIVE or the join timeout passes (then name the missing
nodes), run the head command against the explicit head address, watch the nodes while it
runs (a lost node fails the job fast), then publish the exit code, wait until the live
workers have seen it, stop its Ray and exit with that code.

Worker: stop any Ray this job left on the node, wait for the head's GCS to accept nodes
(polling with backoff, bounded by the join timeout), join, then follow the head: leave with
its exit code when it is done, or fail when the head is lost.

The join timeout counts from the moment `rlx node` starts, on every node: the head names
the missing nodes, and a worker gives up on the head, within that time of its own start.

Head and workers talk only through the GCS key-value store (namespace "rlx"): the head's
state goes "waiting" -> "running" -> "done:<code>", and each worker acknowledges "done".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from rlx.errors import TRY_AGAIN, RlxError
from rlx.node import raynode
from rlx.node.env import RAY_TOKEN_SECRET, NodeInfo, fabric_env
from rlx.recipe.model import Recipe

# Exit code when the cluster itself failed (a node never joined or was lost), as opposed to
# the trainer failing: worth a retry.
CLUSTER_FAILURE = TRY_AGAIN
RAY_START_TIMEOUT = 180.0
# `ray start` on a node whose raylet missed Ray's fixed 30 s to register and died: how many
# times in all, each within the join timeout.
RAY_START_TRIES = 3
POLL_SECONDS = 1.0
# How long a failed head command waits for the GCS to say whether a node was lost (its
# health checks declare a dead raylet within about 7 s; see raynode.FAST_FAILURE_ENV).
LOSS_GRACE_SECONDS = 10.0
GCS_CONNECT_SECONDS = 5
JOIN_POLL_SECONDS = 0.1  # polls while the cluster forms: each is one cheap GCS call
HEAD_LOST_SECONDS = 15.0  # a worker waits this long without the head before giving up
ACK_WAIT_SECONDS = 15.0
TERMINATE_GRACE_SECONDS = 20.0
# SIGTERM while the job runs is a preemption or a cancel: the head passes it to the trainer,
# which saves the step it finished and exits 75, and every node keeps its Ray up for that
# long at most (GCP spot gives 30 s before the power goes).
PREEMPT_GRACE_SECONDS = 25.0
# After a signal, Ray's daemons get this long per step (TERM, then KILL) to go: the whole
# clean-up must end well inside a scheduler's kill wait (Slurm's KillWait: 30 s by default,
# often less), or the scheduler's SIGKILL ends it with the GCS still up.
SIGNALLED_STOP_GRACE = 1.0
PORTS_FREED_SECONDS = 10.0  # what was stopped at start-up has this long to let go of its ports
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


class ClusterError(RlxError):
    """The cluster itself failed: a node never joined, or a node or the head was lost."""


class Stop(Exception):
    """Raised from a signal handler so clean-up runs on SIGTERM/SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


@dataclass
class Bootstrap:
    recipe: Recipe
    node: NodeInfo
    env: Mapping[str, str]
    out: TextIO = field(default_factory=lambda: sys.stderr)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.started = self.clock()
        token = None
        if self.recipe.ray.auth == "token":
            token = self.env.get(RAY_TOKEN_SECRET, "").strip()
            if not token:
                raise RlxError(
                    f"{RAY_TOKEN_SECRET} is not set: launch with `rlx launch`, which makes a "
                    f"fresh token per job, or pass it as a secret ({RAY_TOKEN_SECRET}=$(openssl "
                    "rand -hex 32)); or set ray.auth: none in the recipe"
                )
        self.ray_env = raynode.ray_env(self.env, token, self.recipe.ray.debug)
        self.fabric_env = fabric_env(self.recipe, self.ray_env)
        self.ray_env.update(self.fabric_env)
        # The GCS client in this process reads auth settings from os.environ.
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            if key in self.ray_env:
                os.environ[key] = self.ray_env[key]
            else:
                os.environ.pop(key, None)
        # Our client gives up on an address that does not answer like a GCS within seconds
        # (Ray's default is 30 s) and the next poll tries again; Ray's processes keep theirs.
        os.environ[raynode.GCS_CONNECT_TIMEOUT_ENV] = str(GCS_CONNECT_SECONDS)
        self.address = f"{self.node.head_ip}:{self.recipe.ray.port}"
        self.slow_head_raylet = False  # the head's `ray start` gave up on its raylet

    def say(self, message: str) -> None:
        now = time.time()  # milliseconds: bring-up and failure detection are timed from logs
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        print(f"rlx node {self.node.rank} {stamp} {message}", file=self.out, flush=True)

    # ------------------------------------------------------------------ entry point

    def run(self) -> int:
        self.running = False  # the head command has started (set by both sides)
        self.terminated_at: float | None = None  # when SIGTERM came, if it came then

        def handler(signum: int, _frame: object) -> None:
            # While the job runs, SIGTERM is not an immediate stop: the head command gets it
            # and has PREEMPT_GRACE_SECONDS to save and exit; the nodes hold on till then.
            # Not on Slurm: it signals every process of the step, Ray's daemons too, so there
            # is nothing to hold on to (its warning, USR1, is how a Slurm job saves first).
            if signum == signal.SIGTERM and self.running and self.holds_on:
                if self.terminated_at is None:
                    self.terminated_at = self.clock()
                    self.say("received SIGTERM: the job saves and stops (preemption grace)")
                return
            raise Stop(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        # Until the head command runs, the checkpoint warning has nothing to checkpoint.
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.node.backend == "slurm":
            adopt_orphans()
        grace = 5.0
        try:
            left = raynode.stop_own_ray(self.address, self.recipe.ray.port)
            if left:
                self.say(f"stopped {left} Ray processes left by an earlier attempt")
            # A process killed outright shows as a zombie while its other threads still close
            # its sockets: the ports of what was just stopped get a moment to come free.
            self.check_ports(wait=PORTS_FREED_SECONDS if left else 0.0)
            if self.fabric_env:
                settings = " ".join(f"{k}={v}" for k, v in self.fabric_env.items())
                self.say(f"resources.fabric {self.recipe.resources.fabric}: {settings}")
            return self.run_head() if self.node.is_head else self.run_worker()
        except ClusterError as exc:
            self.say(f"error: {exc}")
            return CLUSTER_FAILURE
        except Stop as stop:
            self.say(f"received {stop}; stopping")
            grace = SIGNALLED_STOP_GRACE
            return stop.code
        finally:
            # The clean-up is not cut short by a signal: a scheduler's cancel (SIGTERM) that
            # lands while it runs would otherwise end this process with Ray's daemons still
            # up, re-parented out of the job's process tree (Slurm's proctrack/linuxproc then
            # never kills them); past the scheduler's kill wait its SIGKILL takes the tree.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            try:
                raynode.stop_own_ray(self.address, self.recipe.ray.port, grace=grace)
            finally:
                for sig, old in previous.items():
                    signal.signal(sig, old)

    @property
    def holds_on(self) -> bool:
        """SIGTERM while the job runs lets it save first, and our Ray keeps SIGTERM blocked
        so that a SIGTERM to every process of the node (a spot reclaim) does not take the
        GCS, the raylets and the trainer's actors before the save (rlx.sigterm). Not on
        Slurm: its warning before the end is USR1, and its cancel stops at once."""
        return self.node.backend != "slurm"

    def check_ports(self, wait: float = 0.0) -> None:
        """Fail, naming the recipe field, when another program holds one of our ports (after
        `wait` seconds at most): `ray start` itself would only give up after Ray's own
        timeouts."""
        settings = self.recipe.ray
        ports = raynode.fixed_ports(settings, self.node.is_head)
        taken = raynode.taken_ports(ports)
        deadline = time.monotonic() + wait
        for delay in raynode.backoff(start=0.05, cap=0.5):
            if not taken or time.monotonic() >= deadline:
                break
            time.sleep(delay)
            taken = raynode.taken_ports(ports)
        if taken:
            listed = ", ".join(f"ray.{name} ({ports[name]})" for name in taken)
            raise RlxError(
                f"{listed} already in use on this node ({self.node.describe(self.node.rank)}) "
                "by another program; choose free ports in the recipe's ray section"
            )

    # ------------------------------------------------------------------ head

    @property
    def join_deadline(self) -> float:
        return self.started + self.recipe.ray.join_timeout

    def run_head(self) -> int:
        node, settings = self.node, self.recipe.ray
        sizes = (
            f"{node.num_nodes} nodes, {node.gpus_per_node} GPUs each"
            if not node.groups
            else f"{node.num_nodes} nodes: " + _group_sizes(node)
        )
        self.say(f"starting the Ray head on {node.head_ip}:{settings.port} ({sizes})")
        # Import Ray's client while the GCS starts, so the workers hear of it at once.
        threading.Thread(target=raynode.preload, daemon=True).start()
        for attempt in range(1, RAY_START_TRIES + 1):
            try:
                gcs, alive = self.start_head_ray()
                break
            except RlxError as e:
                # Ray's CLI gave the head's raylet its fixed 30 s and the raylet is gone (a
                # loaded machine): start the head again while the join timeout allows. The
                # workers see the new head's attempt and join it.
                if (
                    raynode.RAYLET_SLOW not in str(e)
                    or attempt == RAY_START_TRIES
                    or self.clock() >= self.join_deadline
                ):
                    raise
                raynode.stop_own_ray(self.address, settings.port)
                self.slow_head_raylet = False
                self.say(
                    "the head's raylet did not register within Ray's 30 s and is gone; "
                    f"starting Ray on the head again (try {attempt + 1} of {RAY_START_TRIES})"
                )
        gcs.put(raynode.STATE_KEY, b"running")
        code = self.run_head_command(gcs, alive)
        gcs.put(raynode.STATE_KEY, f"done:{code}".encode())
        self.wait_for_acks(gcs)
        return code

    def start_head_ray(self) -> tuple[raynode.Gcs, set[str]]:
        """`ray start --head`, then wait for every node; our GCS and the nodes alive."""
        node, settings = self.node, self.recipe.ray
        argv = raynode.head_command(settings, node.head_ip, node.gpus_per_node, node.own_group)
        start = raynode.RayStart(argv, self.ray_env, self.holds_on)
        try:
            gcs = self.open_head_gcs(start)
            gcs.put(raynode.ATTEMPT_KEY, os.urandom(8).hex().encode())
            gcs.put(raynode.STATE_KEY, b"waiting")
            try:
                return gcs, self.wait_for_nodes(gcs, start)
            except ClusterError:
                gcs.put(raynode.STATE_KEY, f"done:{CLUSTER_FAILURE}".encode())
                self.wait_for_acks(gcs)
                raise
        finally:
            start.stop()

    def head_started(self, start: raynode.RayStart) -> bool:
        """True once the head's `ray start` has finished well; raises if it failed. A
        raylet that did not register within Ray's fixed 30 s is not a failure while it
        runs: the node then counts as joined once the GCS lists it, within the join timeout
        like any other node."""
        try:
            return start.check()
        except RlxError as e:
            if raynode.RAYLET_SLOW not in str(e):
                raise
            if not self.slow_head_raylet:
                if not raynode.raylet_alive(self.address, self.recipe.ray.port):
                    raise
                self.slow_head_raylet = True
                self.say(
                    "`ray start --head` gave up on the head's raylet after Ray's 30 s; "
                    "waiting for it until the join timeout"
                )
            return True

    def open_head_gcs(self, start: raynode.RayStart) -> raynode.Gcs:
        """A client of our GCS once it accepts nodes, while `ray start` still brings up the
        rest of the head."""
        deadline = self.clock() + RAY_START_TIMEOUT
        gcs: raynode.Gcs | None = None
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS):
            done = self.head_started(start)  # raises if `ray start` failed
            try:
                if gcs is None and raynode.port_open(self.node.head_ip, self.recipe.ray.port):
                    gcs = raynode.Gcs(self.address)
                if gcs is not None and gcs.accepts_nodes():
                    return gcs
            except Exception:
                gcs = None  # still starting
            if done:
                raise ClusterError(
                    f"`ray start --head` finished but its GCS on {self.address} does not answer"
                )
            if self.clock() >= deadline:
                raise RlxError(f"`ray start --head` did not finish within {RAY_START_TIMEOUT} s")
            time.sleep(delay)
        raise AssertionError("unreachable")

    def wait_for_nodes(self, gcs: raynode.Gcs, start: raynode.RayStart) -> set[str]:
        node = self.node
        want_gpus = node.expected_gpus
        last_report = 0
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS):
            started = self.head_started(start)  # the head's own `ray start` must finish well too
            try:
                states = [s for s in gcs.nodes() if s.alive]
            except Exception:  # a GCS hiccup: the next poll (or the deadline) decides
                states = []
            alive = {s.ip for s in states}
            gpus = sum(s.gpus for s in states)
            if started and alive >= set(node.node_ips) and gpus >= want_gpus:
                self.say(f"all {node.num_nodes} nodes joined ({gpus:.0f} GPUs)")
                cpus = sum(s.cpus for s in states)
                self.say(
                    f"cluster formed: {len(alive)}/{node.num_nodes} nodes online, "
                    f"{gpus:.0f}/{want_gpus} GPUs, {cpus:.0f} CPUs"
                )
                if node.groups:
                    self.check_groups(states)
                return alive
            joined = len(alive & set(node.node_ips))
            if joined != last_report:
                last_report = joined
                self.say(f"{joined}/{node.num_nodes} nodes joined")
            if self.clock() >= self.join_deadline:
                missing = [
                    node.describe(r) for r, ip in enumerate(node.node_ips) if ip not in alive
                ]
                if missing:
                    detail = f"missing {', '.join(missing)}"
                elif not started:
                    detail = "the head's own `ray start` has not finished"
                else:
                    detail = f"only {gpus:.0f} of {want_gpus} GPUs registered"
                raise ClusterError(
                    f"the cluster did not form within {self.recipe.ray.join_timeout} s: "
                    f"{detail}; check those nodes' logs (the trainer was not started)"
                )
            time.sleep(delay)
        raise AssertionError("unreachable")

    def check_groups(self, states: list[raynode.NodeState]) -> None:
        """Every node carries its group's label (placement selects by it): say which nodes
        each group has, as Ray's node table sees it, and fail on a node labelled otherwise."""
        node = self.node
        labelled = {s.ip: s.group for s in states}
        wrong = [
            f"{node.describe(r)} is labelled {labelled.get(ip)!r}"
            for r, ip in enumerate(node.node_ips)
            if labelled.get(ip) != node.groups[r]
        ]
        if wrong:
            raise ClusterError(
                f"nodes joined with another group's label: {'; '.join(wrong)} (the trainer "
                "was not started)"
            )
        members = zip(node.node_ips, node.groups, strict=True)
        by_group: dict[str, list[str]] = {}
        for ip, name in members:
            by_group.setdefault(name, []).append(ip)
        listed = "; ".join(f"{name}: {', '.join(ips)}" for name, ips in by_group.items())
        self.say(f"node groups (Ray label {raynode.NODE_GROUP_LABEL}): {listed}")

    def head_command_env(self) -> dict[str, str]:
        node = self.node
        env = dict(self.ray_env)
        env.update(
            {
                "RAY_ADDRESS": self.address,
                "RLX_NUM_NODES": str(node.num_nodes),
                "RLX_GPUS_PER_NODE": str(node.gpus_per_node),
                "RLX_NODE_IPS": "\n".join(node.node_ips),
                "RLX_BACKEND": node.backend,
            }
        )
        if node.run_id:
            env["RLX_RUN_ID"] = node.run_id
        for key in raynode.FAST_FAILURE_ENV:
            env.pop(key, None)  # GCS settings, not meant for the trainer's own processes
        return env

    def run_head_command(self, gcs: raynode.Gcs, alive: set[str]) -> int:
        # bash ignores USR1 (the checkpoint warning) so only programs that ask for it, the
        # trainer, get it; by default it would end bash and orphan the trainer. Where the
        # node holds on, a SIGTERM (to every process of the node, on a spot reclaim) must not
        # end bash either: the trap keeps it waiting for the trainer's answer (75 once saved),
        # and unlike '' it is not inherited, so the trainer still gets the signal.
        traps = "set -e\ntrap '' USR1\n" + ("trap : TERM\n" if self.holds_on else "")
        script = traps + "\n".join(self.recipe.head_command) + "\n"
        self.say("running: " + " && ".join(self.recipe.head_command))
        proc = subprocess.Popen(
            ["bash", "-c", script], env=self.head_command_env(), start_new_session=True
        )

        def warn(_signum: int, _frame: object) -> None:
            self.say("received SIGUSR1: passing it to the head command (checkpoint and stop)")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGUSR1)

        signal.signal(signal.SIGUSR1, warn)
        self.running = True
        forwarded = False
        try:
            while True:
                if self.terminated_at is not None and not forwarded:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    forwarded = True
                if forwarded and self.clock() - self.terminated_at > PREEMPT_GRACE_SECONDS:
                    self.say(
                        f"the head command did not stop within {PREEMPT_GRACE_SECONDS:.0f} s "
                        "of SIGTERM; killing it"
                    )
                    self.running = False
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    raise Stop(signal.SIGTERM)
                try:
                    code = proc.wait(timeout=POLL_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
                else:
                    self.running = False
                    if code < 0:  # ended by a signal: the shell's convention, 128 + n
                        code = 128 - code
                    return self.cluster_or_command_failure(gcs, alive, code)
                lost = self.lost_nodes(gcs, alive)
                if lost:
                    self.say(f"lost {', '.join(lost)}; stopping the job")
                    self.terminate(proc)
                    return CLUSTER_FAILURE
        finally:
            self.terminate(proc)

    def cluster_or_command_failure(self, gcs: raynode.Gcs, alive: set[str], code: int) -> int:
        """The head command's exit code, unless it failed because a node was lost: a
        trainer's collective can fail on a dead peer seconds before the GCS declares the
        node dead. A failed command therefore waits up to LOSS_GRACE_SECONDS for that
        verdict; a lost node makes it a cluster failure (75: worth a retry)."""
        if code == 0 or code == CLUSTER_FAILURE or len(self.node.node_ips) == 1:
            return code  # one node: there is no other node whose loss could explain it
        deadline = self.clock() + LOSS_GRACE_SECONDS
        while True:
            lost = self.lost_nodes(gcs, alive)
            if lost:
                self.say(
                    f"lost {', '.join(lost)}; the head command's failure (exit code {code}) "
                    "is the cluster's"
                )
                return CLUSTER_FAILURE
            if self.clock() >= deadline:
                return code
            time.sleep(POLL_SECONDS)

    def lost_nodes(self, gcs: raynode.Gcs, alive: set[str]) -> list[str]:
        try:
            now = {s.ip for s in gcs.nodes() if s.alive}
        except Exception:  # a GCS hiccup is not a lost node; the next poll decides
            return []
        return [
            self.node.describe(r)
            for r, ip in enumerate(self.node.node_ips)
            if ip in alive and ip not in now
        ]

    def terminate(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, TERMINATE_GRACE_SECONDS), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def wait_for_acks(self, gcs: raynode.Gcs) -> None:
        """Give the workers still alive a moment to see the outcome before our GCS goes
        (a lost worker cannot confirm: waiting for it would only delay the exit)."""
        node = self.node
        if node.num_nodes == 1:
            return
        deadline = self.clock() + ACK_WAIT_SECONDS
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS):
            try:
                keys = gcs.keys(raynode.ACK_PREFIX)
                acked = {int(key[len(raynode.ACK_PREFIX) :]) for key in keys}
                alive = {s.ip for s in gcs.nodes() if s.alive}
            except Exception:
                return
            waiting = [
                rank
                for rank in range(1, node.num_nodes)
                if rank not in acked and node.node_ips[rank] in alive
            ]
            if not waiting:
                return
            if self.clock() >= deadline:
                names = ", ".join(node.describe(rank) for rank in waiting)
                self.say(f"{names} did not confirm the end; stopping anyway")
                return
            time.sleep(delay)

    # ------------------------------------------------------------------ worker

    def run_worker(self) -> int:
        settings = self.recipe.ray
        # Ray's client library takes a good fraction of a second to import: do it while the
        # head is still starting, not once its GCS is up and every moment counts.
        threading.Thread(target=raynode.preload, daemon=True).start()
        while True:
            gcs, attempt = self.wait_for_head(self.join_deadline)
            if not self.wait_for_head_node(gcs, attempt):
                self.say("the head restarted before its node registered; waiting for it again")
                continue
            self.say(f"joining the head at {self.address}")
            if not self.start_worker_ray(gcs):
                self.say("the head's node left the cluster while this node joined; joining again")
                raynode.stop_own_ray(self.address, settings.port)
                continue
            outcome = self.follow_head(gcs, attempt)
            if outcome is not None:
                return outcome
            # The head went away before the job started: an earlier attempt's head was being
            # replaced. Leave it and join the new one.
            raynode.stop_own_ray(self.address, settings.port)
            self.say("the head restarted before the job began; joining again")

    def start_worker_ray(self, gcs: raynode.Gcs) -> bool:
        """`ray start` on this worker. Ray's CLI gives a raylet a fixed 30 s to register
        with the GCS and then fails, though the raylet goes on starting; on a loaded node
        (or with a busy GCS) that is not enough. The join timeout is ours to keep: wait
        for the raylet until then, and start again if it died (RAY_START_TRIES in all).
        False when the head's own node is missing from its GCS: wait for the head again."""
        node, settings = self.node, self.recipe.ray
        argv = raynode.worker_command(
            settings, node.head_ip, node.own_ip, node.gpus_per_node, node.own_group
        )
        for attempt in range(1, RAY_START_TRIES + 1):
            try:
                raynode.run_ray_start(argv, self.ray_env, RAY_START_TIMEOUT, self.holds_on)
                return True
            except RlxError as e:
                if raynode.HEAD_NODE_MISSING in str(e) and self.clock() < self.join_deadline:
                    return False
                if raynode.RAYLET_SLOW not in str(e) or self.clock() >= self.join_deadline:
                    raise
                self.say(
                    "`ray start` gave up on this node's raylet after Ray's 30 s; waiting "
                    f"for it until the join timeout ({self.recipe.ray.join_timeout} s)"
                )
                if self.wait_for_own_raylet(gcs):
                    return True
                if attempt == RAY_START_TRIES or self.clock() >= self.join_deadline:
                    raise
                raynode.stop_own_ray(self.address, settings.port)
                self.say(
                    "this node's raylet is gone; starting Ray again "
                    f"(try {attempt + 1} of {RAY_START_TRIES})"
                )
        raise AssertionError("unreachable")

    def wait_for_head_node(self, gcs: raynode.Gcs, attempt: bytes) -> bool:
        """Wait until the head's own node is alive in its GCS: a worker's `ray start` reads
        it at once and fails when it is not there yet (the head's raylet may still be
        registering on a loaded machine). False if the head restarted meanwhile."""
        head_ip = self.node.head_ip
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS):
            with contextlib.suppress(Exception):  # a GCS hiccup: the next poll decides
                if any(s.alive and s.ip == head_ip for s in gcs.nodes()):
                    return True
                if gcs.get(raynode.ATTEMPT_KEY) != attempt:
                    return False
            if self.clock() >= self.join_deadline:
                raise ClusterError(
                    f"the head ({self.node.describe(0)}) did not register its own node within "
                    f"{self.recipe.ray.join_timeout} s; check the head node's log"
                )
            time.sleep(delay)
        raise AssertionError("unreachable")

    def wait_for_own_raylet(self, gcs: raynode.Gcs) -> bool:
        """True once this node is alive in the GCS; False if its raylet exits first or the
        join deadline passes."""
        settings = self.recipe.ray
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS * 10):
            with contextlib.suppress(Exception):  # a GCS hiccup: the next poll decides
                if any(s.alive and s.ip == self.node.own_ip for s in gcs.nodes()):
                    return True
            if not raynode.raylet_alive(self.address, settings.port):
                return False
            if self.clock() >= self.join_deadline:
                return False
            time.sleep(delay)
        raise AssertionError("unreachable")

    def wait_for_head(self, deadline: float) -> tuple[raynode.Gcs, bytes]:
        """Wait until the head's GCS is up and accepting nodes ("waiting"); the GCS and the
        head attempt it belongs to."""
        port = self.recipe.ray.port
        told = False
        gcs: raynode.Gcs | None = None
        for delay in raynode.backoff(cap=JOIN_POLL_SECONDS):
            try:
                # A GCS left by an earlier attempt may answer until its head replaces it:
                # keep one client while it works, make a new one once it fails.
                if gcs is None and raynode.port_open(self.node.head_ip, port):
                    gcs = raynode.Gcs(self.address)
                if gcs is not None:
                    attempt = gcs.get(raynode.ATTEMPT_KEY)
                    if attempt and gcs.get(raynode.STATE_KEY) == b"waiting":
                        return gcs, attempt
            except Exception:
                gcs = None  # a GCS still starting, or an old one being stopped
            if self.clock() >= deadline:
                raise ClusterError(
                    f"the head ({self.node.describe(0)}) did not come up on port {port} within "
                    f"{self.recipe.ray.join_timeout} s; check the head node's log"
                )
            if not told:
                self.say(f"waiting for the head at {self.address}")
                told = True
            time.sleep(delay)
        raise AssertionError("unreachable")

    def follow_head(self, gcs: raynode.Gcs, attempt: bytes) -> int | None:
        """Block until the head is done. Its exit code; None if the head vanished or was
        replaced while still waiting for nodes (a restarted head: join again)."""
        settings = self.recipe.ray
        last_state = b"waiting"
        last_contact = self.clock()
        while True:
            time.sleep(POLL_SECONDS)
            try:
                state = gcs.get(raynode.STATE_KEY) or b""
                current = gcs.get(raynode.ATTEMPT_KEY)
                last_contact = self.clock()
            except Exception:
                if self.clock() - last_contact < HEAD_LOST_SECONDS:
                    continue
                if last_state == b"waiting":
                    return None
                raise ClusterError(
                    f"lost the head ({self.node.describe(0)}) while the job was "
                    "running; see the head node's log"
                ) from None
            if current != attempt:
                if last_state == b"waiting":
                    return None
                raise ClusterError(
                    f"the head ({self.node.describe(0)}) restarted while the job "
                    "was running; this attempt is over"
                )
            if state.startswith(b"done:"):
                self.running = False
                code = int(state.split(b":", 1)[1])
                with contextlib.suppress(Exception):
                    gcs.put(raynode.ACK_PREFIX + str(self.node.rank).encode(), b"1")
                self.say(f"the head finished with exit code {code}; leaving")
                return code
            # SIGTERM here: hold on while the head's job saves (its done state ends the wait),
            # for PREEMPT_GRACE_SECONDS at most; before the job runs, leave at once.
            self.running = state == b"running"
            if self.terminated_at is not None and (
                not self.running or self.clock() - self.terminated_at > PREEMPT_GRACE_SECONDS
            ):
                raise Stop(signal.SIGTERM)
            last_state = state
            if not raynode.raylet_alive(self.address, settings.port):
                raise ClusterError(
                    f"Ray stopped on this node ({self.node.describe(self.node.rank)})"
                    "; see /tmp/ray/session_latest/logs/raylet.out"
                )


def adopt_orphans() -> bool:
    """Keep the daemons `ray start` leaves behind in this process's tree (Slurm only).

    `ray start` exits once its daemons run, and they would be re-parented to init: outside
    the step's process tree, which is how Slurm's proctrack/linuxproc finds what to SIGKILL
    after KillWait. As a child subreaper this process stays their parent, so a job whose
    clean-up is cut short by that SIGKILL takes its GCS with it. Not elsewhere: a sky or
    dstack run block killed outright must leave the daemons for the retry to clean up, as a
    crashed job runner does. Linux only; elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _group_sizes(node: NodeInfo) -> str:
    """'train 1 x 8 GPUs, rollout 2 x 4 GPUs'."""
    parts = []
    for name in dict.fromkeys(node.groups):
        ranks = [r for r, g in enumerate(node.groups) if g == name]
        parts.append(f"{name} {len(ranks)} x {node.node_gpus[ranks[0]]} GPUs")
    return ", ".join(parts)


def main(recipe: Recipe, node: NodeInfo, env: Mapping[str, str]) -> int:
    return Bootstrap(recipe, node, env).run()
