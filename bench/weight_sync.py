"""What a split-layout weight push costs, counted in every process that takes part: host bytes
copied per pushed byte, collective bytes per training rank, and seconds, for a Qwen2.5-0.5B
shaped policy (bench/shapes.py, float32, 494M parameters: 1.98 GB per push), with the same
measurement of a baseline revision beside it.

    python bench/weight_sync.py [--baseline REV] [--after REV] [--setups 2x2 1x1]
                                [--buckets 256] [--repeats 2] [--layers 24]
                                [--engine-raylet shared|own] [--wait 300] [--retries 1]
                                [--no-ledger] [--sites] [--keep] [--verbose]

--baseline REV measures a git worktree of REV (made under /tmp, removed after) as "before" and
the working tree (rlx/ as it is now, uncommitted edits included) as "after"; without it, the
working tree alone. --after REV measures a revision instead of the working tree (while
someone edits rlx/, a half-made tree may not import). Only the code under test comes from a
worktree: this file, bench/shapes.py and the ledger are copied from the working tree when the
bench starts and serve every side, so both are measured by the same harness. The output names
each side's commit (and a digest of uncommitted rlx/ changes) at the start and at the end.

--setups RxT: R training ranks (FSDP when R > 1, gloo, one rank per raylet as CPU jobs place
them) and one vLLM engine of tensor_parallel_size T on vLLM's CPU build: T = 2 runs the mp
executor (an engine-core process and two worker processes, a core each), T = 1 runs in the
engine's actor. rlx train refuses T > 1 without GPUs (lint's check_tensor_parallel), though
its rollout worker runs such an engine; the bench's driver lifts that one start-up check.
--buckets: trainer.rollout.weight_sync_bucket_mb (MiB; "whole": one bucket holding the
model); several values are compared side by side. --engine-raylet: the engine beside rank 0
(default) or on a raylet of its own, as on a node of its own; then Ray copies every bucket
from rank 0's store into the engine's (inferred, below), and 2x2 at 24 layers needs more than
the 24 GB this machine has (Ray's memory monitor killed a worker).

Each setting runs in a child process: a driver with the tree under test first on sys.path
starts a Ray cluster of raylets on this machine (ray.cluster_utils, a CPU each), builds the
trainer with rlx.trainer.main.trainer_for and drives only Cluster.sync_weights(version,
probe) with trainer.inputs.probe, the entry points the rewrite keeps (memory_peak and
host_memory of the workers are used when present). After a warm-up (the probe, one push),
each of --repeats rounds times two windows: sync_weights(v, probe, push=False), which only
checks (every rank's and every engine's probe forward), then sync_weights(v + 1, probe), a
push and the same check. What the push costs is the push window minus the check window,
process by process and item by item (medians over the rounds).

The copy ledger (bench/ledger/copyledger.py; its docstring lists every hook) does the
counting. The child's environment carries RLX_COPY_LEDGER and puts bench/ledger first on
PYTHONPATH, so its sitecustomize.py installs the ledger in every Python process of the push:
the driver, the training ranks, the engine's actor, vLLM's engine core and its workers
(spawned or forked), and Ray's helpers. Each process appends timed events to a file of its
own; the child adds up the events inside each window. Counted:
  - host copies: torch copy-like operators on CPU tensors (a TorchDispatchMode on every
    thread: copy_, _to_copy, clone, cat, stack, padding, the *_copy operators), pickle
    streams written and read (pickle, cloudpickle and Ray's pickling; in-band bytes only),
    torch's tensor reduction (a storage torch.saved into bytes, torch.loaded back), msgspec
    msgpack encoding (vLLM's rpc messages), vLLM's shared-memory ring, Ray's serialisation
    into its object store;
  - the destination, apart: copies made under vllm/model_executor/ (vLLM's load_weights and
    its layerwise reload writing the engine's parameters), which every design makes;
    reported, never counted as overhead;
  - the wire, apart, never as host copies: torch.distributed collectives (c10d operators,
    ProcessGroup methods, backends such as ProcessGroupGloo called directly, DTensor's and
    FSDP's gathers, vLLM's PyNcclCommunicator) as bytes received from and sent to other
    ranks (a ring's logical traffic); ZMQ frames between vLLM's processes; Ray objects read
    on a raylet where none was written in the window (inferred as moved between stores).
Not seen (so every figure is a floor): copies in C code that calls neither Python nor a
torch operator: the kernel's two copies of every socket byte (ZMQ over ipc, gloo over tcp,
Ray's transfers), libzmq's own copies, gloo's copy of a rank's own chunk, Ray's writes into
the receiving store of a transfer (inferred and counted as one copy, "ray: into the reader's
store"), bytes()/bytearray()/memoryview/BytesIO.getvalue() copies in Python other than
vLLM's ring, numpy copies, copies inside vLLM's C++ ops (the CPU build's weight repacking)
and redistributions DTensor makes inside an operator.

Output, per setup and bucket size, a column per side and their ratio:
  - push s: the median seconds of sync_weights with a push; check s: of the check alone
    (push=False); net s: their difference, the push itself; first push s: the warm-up push.
    Timed with the ledger on (a Python call per torch operator, small beside a push;
    --no-ledger times without it);
  - sender MiB: rank 0's peak resident memory during a push above its resident memory before
    it; machine MiB: the largest drop of MemAvailable during a push (every process and the
    object store), medians;
  - host bytes copied per pushed byte, per engine: bytes / (model bytes in the engine dtype x
    engines), by process (rank 0, rank 1, engine actor, engine core, TP workers summed,
    controller, other) and mechanism; the total leaves out the destination, shown on its own;
  - the wire per pushed byte per engine, and the collective GB each training rank received
    and sent for one push.
--sites adds, per process, the call sites of the largest items.

The load average (os.getloadavg) is printed at the start, before each side and at the end,
with a warning above 0.5 per core: a time taken on a busy machine is not a result (the byte
counts do not depend on the load). Before each side the bench waits up to --wait seconds for
a quiet machine with the memory the setting needs (19 GiB free for a tp-2 engine: 2 ranks
and a tp-2 engine peaked near 18 GiB on today's path, and Ray's memory monitor kills a worker
at 95% of the machine's memory, whoever uses it), and a side that fails is run again
(--retries) before the bench goes on without it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LEDGER = BENCH / "ledger"
sys.path.insert(0, str(BENCH))

MIB = 2**20
GB = 1e9
WARM_PUSHES = 1
QUIET = 0.5  # load average per core above which a figure is not a result

# The ledger's kinds, in the order of the table: host copies, the destination, the wire.
HOST_KINDS = {
    "copy": "torch copies",
    "tensor-to-bytes": "tensor -> bytes (torch.save in pickling)",
    "bytes-to-tensor": "bytes -> tensor (torch.load in unpickling)",
    "pickle-out": "pickle stream written",
    "pickle-in": "pickle stream read",
    "msgpack-out": "msgpack encoded",
    "shm-write": "vLLM shm ring written",
    "shm-read": "vLLM shm ring read out",
    "ray-write": "ray: into the object store",
    "ray-transfer": "ray: into the reader's store (inferred)",
    "d2h": "device -> host",
}
DEST_KINDS = {"dest": "destination: vLLM load_weights, reload"}
DEVICE_KINDS = {"h2d": "host -> device"}
WIRE_KINDS = {
    "coll-recv": "collectives received",
    "coll-sent": "collectives sent",
    "zmq-send": "zmq frames sent",
    "zmq-recv": "zmq frames received",
    "ray-transfer": "ray: between raylets (inferred)",
}
ROLE_ORDER = ("rank", "engine actor", "engine core", "TP workers", "controller", "other")


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class LowWater:
    """The lowest MemAvailable seen while the block runs (a sampling thread)."""

    def __enter__(self) -> LowWater:
        self.start = self.low = mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.low = min(self.low, mem_available())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.low = min(self.low, mem_available())

    @property
    def drop(self) -> int:
        return max(self.start - self.low, 0)


# =========================================================================== the child


def recipe_for(spec: dict) -> Any:
    from rlx.recipe import parse_recipe

    bucket = spec["bucket"]
    recipe = {
        "name": "bench-weight-sync",
        "resources": {"nodes": spec["ranks"]},
        "trainer": {
            "algorithm": "grpo",
            "layout": "split",
            "rollout_gpus": 1,  # on CPU: one rollout actor (one engine)
            "model": {"path": spec["model"], "dtype": "float32"},
            "data": {"train": spec["data"], "max_prompt_length": 32},
            "reward": {"function": "letters_or_digits"},
            "rollout": {
                "engine": "vllm",
                "n": 2,
                "max_new_tokens": 8,
                "tensor_parallel_size": spec["tp"],
                "weight_sync_bucket_mb": 2**20 if bucket == "whole" else int(bucket),
            },
            "algo": {"kl": {"coef": 0.0}},
            "batch": {"prompts_per_step": 1, "micro_batch_size": 2},
            "steps": 1,
            "seed": 0,
            "logging": {"dir": str(Path(spec["out"]) / "runs"), "tensorboard": False},
        },
    }
    return parse_recipe(json.dumps(recipe), "bench-weight-sync.yaml").recipe


def optional(call: Any, default: Any = None) -> Any:
    """A worker method the rewrite may drop: its result, or default."""
    try:
        return call()
    except Exception:
        return default


def allow_cpu_tensor_parallel() -> None:
    """rlx train refuses tensor_parallel_size > 1 without GPUs (lint's check_tensor_parallel,
    one of rlx.lint.STARTUP_CHECKS), though its rollout worker runs such an engine on CPU
    (vLLM's mp executor, a core per worker): this driver lifts that one check."""
    import rlx.lint

    checks = getattr(rlx.lint, "STARTUP_CHECKS", ())
    rlx.lint.STARTUP_CHECKS = tuple(
        check for check in checks if getattr(check, "__name__", "") != "check_tensor_parallel"
    )


def measure(spec: dict) -> dict:
    """One setting in a Ray cluster of its own: warm-up, then `repeats` rounds of a check
    window and a push window. Returns the windows, times and memory."""
    import ray
    from ray.cluster_utils import Cluster

    from rlx.trainer.main import trainer_for

    os.environ["RAY_AUTH_MODE"] = "disabled"
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(name, None)
    os.environ.setdefault("RLX_NUM_THREADS", "1")
    store = 3 * 2**30
    shared = spec["engine_raylet"] == "shared"
    # Training ranks spread one per raylet (rank 0 on the head); the engine's one-CPU bundle
    # goes where a CPU is left: a raylet of its own, or the head beside rank 0.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2 if shared else 1,
            "include_dashboard": False,
            "object_store_memory": store,
        },
    )
    try:
        for _ in range(spec["ranks"] - 1 if shared else spec["ranks"]):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=spec["verbose"], logging_level="ERROR")
        recipe = recipe_for(spec)
        if spec["tp"] > 1:
            allow_cpu_tensor_parallel()
        with contextlib.ExitStack() as stack:
            log = (
                sys.stderr
                if spec["verbose"]
                else stack.enter_context(open(Path(spec["out"]) / "trainer.log", "w"))
            )
            trainer = stack.enter_context(trainer_for(recipe, {"RLX_RUN_ID": "bench"}, log))
            return run_windows(trainer, spec)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()


def run_windows(trainer: Any, spec: dict) -> dict:
    import ray

    import rlx

    cluster = trainer.cluster
    probe = trainer.inputs.probe
    train, engines = cluster.train.handles, cluster.rollout.handles

    def pids_of(handles: list) -> list[int] | None:
        calls = lambda: ray.get([h.host_memory.remote() for h in handles])  # noqa: E731
        return optional(lambda: [pid for _, pid, _ in calls()])

    pids = {"ranks": pids_of(train), "engines": pids_of(engines), "controller": os.getpid()}
    cluster.sync_weights(0, probe, push=False)
    version = 0
    warm = []
    for _ in range(WARM_PUSHES):
        version += 1
        started = time.perf_counter()
        cluster.sync_weights(version, probe)
        warm.append(time.perf_counter() - started)
    rounds = []
    for _ in range(spec["repeats"]):
        time.sleep(0.5)
        check = window(lambda v=version: cluster.sync_weights(v, probe, push=False))
        time.sleep(0.5)
        version += 1
        before = optional(lambda: ray.get(train[0].memory_peak.remote(True)))
        with LowWater() as machine:
            push = window(lambda v=version: cluster.sync_weights(v, probe))
        peak = optional(lambda: ray.get(train[0].memory_peak.remote()))
        push["sender"] = None if before is None or peak is None else (peak - before) / MIB
        push["machine"] = machine.drop / MIB
        rounds.append({"check": check, "push": push})
    time.sleep(1.5)  # every ledger flushes within 0.2 s
    return {
        "rounds": rounds,
        "warm": warm,
        "pids": pids,
        "rlx": str(Path(rlx.__file__).resolve().parent),
        "engines": len(engines),
    }


def window(call: Any) -> dict:
    start = time.time()
    began = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - began
    return {"start": start, "end": time.time(), "seconds": seconds, "probe_diff": result}


# =========================================================================== adding up


def role_of(meta: dict, pids: dict) -> str:
    title = meta.get("title", "")
    pid = meta.get("pid")
    ranks = pids.get("ranks") or []
    if pid in ranks:
        return f"rank {ranks.index(pid)}"
    if "TrainWorker" in title:
        return f"rank {meta.get('rank', '?')}"
    if pid in (pids.get("engines") or []) or "RolloutWorker" in title:
        return "engine actor"
    if "EngineCore" in title:
        return "engine core"
    if "VLLM::Worker" in title or "Worker_TP" in title:
        return "TP workers"
    if pid == pids.get("controller"):
        return "controller"
    return "other"


def totals(processes: list[dict], start: float, end: float, pids: dict) -> dict:
    """{(role, kind, site): bytes} of the events inside [start, end], with Ray objects read
    on a raylet where none was written in the window counted as transferred."""
    out: dict[tuple[str, str, str], int] = defaultdict(int)
    written_on, read = set(), []
    for process in processes:
        meta = process["meta"]
        role = role_of(meta, pids)
        for stamp, kind, nbytes, detail, site in process["events"]:
            if not start <= stamp <= end:
                continue
            label = site if site else ("(small events)" if detail.startswith("small") else detail)
            out[(role, kind, label)] += nbytes
            if kind == "ray-write" and nbytes >= MIB:
                written_on.add(meta.get("node"))
            if kind == "ray-read" and nbytes >= MIB:
                read.append((role, meta.get("node"), nbytes))
    for role, node, nbytes in read:
        if written_on and node not in written_on:
            out[(role, "ray-transfer", "plasma -> plasma")] += nbytes
    return dict(out)


def summarise(result: dict, processes: list[dict]) -> dict:
    """Per round: push window minus check window at (role, kind, site); then medians."""
    pids = result["pids"]
    per_round = []
    for item in result["rounds"]:
        check, push = item["check"], item["push"]
        pushed = totals(processes, push["start"], push["end"], pids)
        checked = totals(processes, check["start"], check["end"], pids)
        keys = set(pushed) | set(checked)
        per_round.append({k: pushed.get(k, 0) - checked.get(k, 0) for k in keys})
    keys = set().union(*per_round) if per_round else set()
    ledger = {
        "|".join(k): statistics.median(r.get(k, 0) for r in per_round)
        for k in keys
        if any(r.get(k, 0) for r in per_round)
    }
    seen: dict[str, int] = defaultdict(int)  # events inside the push windows, by process
    for process in processes:
        role = role_of(process["meta"], pids)
        for item in result["rounds"]:
            push = item["push"]
            seen[role] += sum(push["start"] <= e[0] <= push["end"] for e in process["events"])
    rounds = result["rounds"]
    sender = [r["push"]["sender"] for r in rounds if r["push"]["sender"] is not None]
    return {
        "push_s": statistics.median(r["push"]["seconds"] for r in rounds),
        "check_s": statistics.median(r["check"]["seconds"] for r in rounds),
        "net_s": statistics.median(r["push"]["seconds"] - r["check"]["seconds"] for r in rounds),
        "first_s": result["warm"][0],
        "probe_diff": max(r["push"]["probe_diff"] for r in rounds),
        "sender": statistics.median(sender) if sender else None,
        "machine": statistics.median(r["push"]["machine"] for r in rounds),
        "ledger": ledger,
        "engines": result["engines"],
        "rlx": result["rlx"],
        "worker_rlx": sorted({p["meta"]["rlx"] for p in processes if p["meta"].get("rlx")}),
        "processes": len(processes),
        "seen": dict(seen),
    }


def child_main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    result = measure(spec)
    processes = []
    if spec["ledger"]:
        import copyledger

        copyledger._flush()
        processes = copyledger.read(spec["ledger_dir"])
    Path(spec["result"]).write_text(json.dumps(summarise(result, processes)))


# =========================================================================== the parent


def load_line(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    cores = os.cpu_count() or 1
    line = f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} ({cores} cores)"
    if one > QUIET * cores:
        line += f"  WARNING: above {QUIET} per core, the machine is busy: not a result"
    return line


def wait_for_room(tp: int, limit: float) -> None:
    """Up to `limit` seconds for the machine to be quiet (1-minute load average at most
    QUIET per core) and to have the memory a setting needs free (2 ranks and a tp-2 engine
    took about 18 GiB at their peak; Ray's memory monitor kills a worker near 95% used)."""
    need = (19 if tp > 1 else 8) * 2**30
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + limit
    said = False
    while time.monotonic() < deadline:
        busy = os.getloadavg()[0] > QUIET * cores
        short = mem_available() < need
        if not busy and not short:
            return
        if not said:
            print(
                f"  waiting up to {limit:.0f} s for a quiet machine with {need / 2**30:.0f} GiB "
                f"free (load {os.getloadavg()[0]:.2f}, {mem_available() / 2**30:.1f} GiB free)",
                flush=True,
            )
            said = True
        time.sleep(10)


def tree_state(tree: Path) -> str:
    """The commit and a digest of uncommitted changes under rlx/ (what the side runs)."""
    head = git(tree, "rev-parse", "--short", "HEAD").strip()
    diff = git(tree, "diff", "HEAD", "--", "rlx")
    untracked = git(tree, "ls-files", "--others", "--exclude-standard", "--", "rlx")
    if not diff and not untracked.strip():
        return f"{head} (clean rlx/)"
    digest = hashlib.sha1((diff + untracked).encode()).hexdigest()[:10]
    return f"{head} + uncommitted rlx/ changes (digest {digest})"


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, text=True
    ).stdout


@contextlib.contextmanager
def worktree(rev: str | None, what: str):
    """A detached git worktree of rev under /tmp (None: no rev, no tree), removed after."""
    if rev is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix=f"rlx-bench-{what}-"))
    git(REPO, "worktree", "add", "--detach", str(folder), rev)
    try:
        yield folder
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git(REPO, "worktree", "remove", "--force", str(folder))
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(subprocess.CalledProcessError):
            git(REPO, "worktree", "prune")


def snapshot_harness(work: Path) -> Path:
    """This file, shapes.py and the ledger as they are now, so that edits made while the
    bench runs change no later child (each child and each of its processes reads them)."""
    harness = work / "harness"
    harness.mkdir()
    shutil.copy2(Path(__file__).resolve(), harness / "weight_sync.py")
    shutil.copy2(BENCH / "shapes.py", harness / "shapes.py")
    shutil.copytree(LEDGER, harness / "ledger", ignore=shutil.ignore_patterns("__pycache__"))
    return harness


def write_inputs(work: Path, layers: int, tree: Path) -> tuple[Path, Path]:
    """The model and the prompts, written by a child (this process keeps torch out of its
    memory: the measured setting needs every GiB the machine has)."""
    code = (
        "import sys; from pathlib import Path; "
        "from shapes import write_qwen25_05b; "
        "from rlx.trainer.tasks.synthetic import write_synthetic_dataset; "
        "work = Path(sys.argv[1]); "
        "write_qwen25_05b(work / 'model', int(sys.argv[2])); "
        "write_synthetic_dataset(work / 'prompts.jsonl', 8, seed=0)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work / "harness"), str(tree)])}
    env.pop("RLX_COPY_LEDGER", None)
    subprocess.run(
        [sys.executable, "-c", code, str(work), str(layers)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return work / "model", work / "prompts.jsonl"


def run_child(tree: Path, spec: dict, work: Path, args: Any) -> dict | None:
    folder = Path(tempfile.mkdtemp(prefix="side-", dir=work))
    spec = {
        **spec,
        "out": str(folder),
        "ledger_dir": str(folder / "ledger"),
        "result": str(folder / "result.json"),
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ)
    harness = work / "harness"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(harness / "ledger"), str(tree)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    if spec["ledger"]:
        env["RLX_COPY_LEDGER"] = spec["ledger_dir"]
    else:
        env.pop("RLX_COPY_LEDGER", None)
    command = [
        sys.executable,
        str(harness / "weight_sync.py"),
        "--_child",
        str(folder / "spec.json"),
    ]
    started = time.perf_counter()
    child = subprocess.run(command, cwd=tree, env=env, capture_output=not args.verbose, text=True)
    if child.returncode != 0 or not Path(spec["result"]).exists():
        stderr = child.stderr or ""
        errors = [ln for ln in stderr.splitlines() if "Error:" in ln or "killed" in ln.lower()]
        seconds = time.perf_counter() - started
        print(f"  failed (exit {child.returncode}) after {seconds:.0f} s")
        for text in errors[-3:]:
            print(f"    {text[:300]}")
        if args.verbose_failures:
            print(stderr[-3000:])
        return None
    result = json.loads(Path(spec["result"]).read_text())
    result["wall_s"] = time.perf_counter() - started
    expected = str((tree / "rlx").resolve())
    strays = [path for path in [result["rlx"], *result["worker_rlx"]] if path != expected]
    if strays:
        print(f"  WARNING: rlx imported from {sorted(set(strays))}, not {expected}")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def by_role(ledger: dict) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key, nbytes in ledger.items():
        role, kind, _ = key.split("|", 2)
        out[role][kind] += nbytes
    return out


def role_key(role: str) -> tuple:
    for index, prefix in enumerate(ROLE_ORDER):
        if role.startswith(prefix):
            return (index, role)
    return (len(ROLE_ORDER), role)


def figures(result: dict, pushed: int) -> dict:
    """The table's rows of one side: {row: value}."""
    roles = by_role(result["ledger"])
    per = pushed * result["engines"]
    rows: dict[tuple, float] = {}
    total = 0.0
    for role in sorted(roles, key=role_key):
        for kind, name in HOST_KINDS.items():
            value = roles[role].get(kind, 0.0) / per
            if value:
                rows[("host", role, name)] = value
                total += value
    rows[("host", "total", "host copies (without the destination)")] = total
    for kind, name in {**DEST_KINDS, **DEVICE_KINDS}.items():
        value = sum(roles[role].get(kind, 0.0) for role in roles) / per
        rows[("dest", "all", name)] = value
    for role in sorted(roles, key=role_key):
        for kind, name in WIRE_KINDS.items():
            value = roles[role].get(kind, 0.0) / per
            if value:
                rows[("wire", role, name)] = value
    for role in sorted(roles, key=role_key):
        if role.startswith("rank"):
            for kind in ("coll-recv", "coll-sent"):
                rows[("gb", role, WIRE_KINDS[kind] + " GB")] = roles[role].get(kind, 0.0) / GB
    return rows


def print_setting(title: str, sides: list[tuple[str, dict | None]], pushed: int) -> None:
    print()
    print(f"== {title} ==")
    names = [name for name, _ in sides]
    done = [(name, r) for name, r in sides if r is not None]
    width = 60
    header = f"{'':{width}}" + "".join(f"{n:>11}" for n in names)
    if len(done) == 2:
        header += f"{'after/before':>14}"
    print(header)

    def line(label: str, values: list[float | None], fmt: str = "{:>11.2f}") -> None:
        text = f"{label:{width}}"
        for value in values:
            text += f"{'-':>11}" if value is None else fmt.format(value)
        if len(values) == 2 and None not in values and values[0]:
            text += f"{values[1] / values[0]:>13.2f}x"
        print(text)

    results = [r for _, r in sides]
    for key, label in (
        ("push_s", "push s (sync_weights, median)"),
        ("check_s", "check s (push=False)"),
        ("net_s", "net s (the push itself)"),
        ("first_s", "first push s (the warm-up push)"),
    ):
        line(label, [None if r is None else r[key] for r in results])
    for key, label, fmt in (
        ("sender", "sender MiB (rank 0 peak above resident)", "{:>11.0f}"),
        ("machine", "machine MiB (MemAvailable drop)", "{:>11.0f}"),
        ("probe_diff", "probe diff (max)", "{:>11.1e}"),
    ):
        line(label, [None if r is None else r[key] for r in results], fmt)
    if not any(r is not None and r["ledger"] for r in results):
        return
    tables = [None if r is None else figures(r, pushed) for r in results]
    keys: list[tuple] = []
    for table in tables:
        for key in table or {}:
            if key not in keys:
                keys.append(key)
    # Rows of every side together: by section, process, then as first seen.
    sections = ("host", "dest", "wire", "gb")
    first = {key: index for index, key in enumerate(keys)}
    keys.sort(key=lambda k: (sections.index(k[0]), role_key(k[1]), first[k]))
    section_titles = {
        "host": "host bytes copied per pushed byte, per engine",
        "dest": "the destination (not overhead) and device copies, per pushed byte per engine",
        "wire": "the wire, not host copies, per pushed byte per engine",
        "gb": "collective GB per training rank per push",
    }
    section = None
    last_role = None
    small = [
        k
        for k in keys
        if k[0] in ("host", "wire")
        and k[1] != "total"
        and all(t is None or abs(t.get(k, 0.0)) < 0.005 for t in tables)
    ]
    for key in keys:
        if key in small:
            continue
        if key[0] != section:
            section = key[0]
            last_role = None
            print(f"  {section_titles[section]}:")
        role = key[1]
        label = f"    {role if role != last_role else '':14}{key[2]}"
        last_role = role
        line(label[:width], [None if t is None else t.get(key, 0.0) for t in tables])
    if small:
        print(f"  ({len(small)} rows under 0.005 each not shown; the totals include them)")


def print_sites(name: str, result: dict, pushed: int, top: int = 6) -> None:
    per = pushed * result["engines"]
    print(f"  {name}: the largest counted items per process (per pushed byte)")
    grouped: dict[str, list] = defaultdict(list)
    for key, nbytes in result["ledger"].items():
        role, kind, site = key.split("|", 2)
        if kind in HOST_KINDS or kind in DEST_KINDS:
            grouped[role].append((nbytes, kind, site))
    for role in sorted(grouped, key=role_key):
        items = sorted(grouped[role], reverse=True)[:top]
        for nbytes, kind, site in items:
            if nbytes / per >= 0.01:
                print(f"    {role:13} {nbytes / per:6.2f}  {kind:16} {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git revision measured as 'before'")
    parser.add_argument(
        "--after", help="measure this revision (a worktree) as 'after', not the working tree"
    )
    parser.add_argument("--setups", nargs="+", default=["2x2", "1x1"], help="RANKSxTP")
    parser.add_argument("--buckets", nargs="+", default=["256"], help="MiB per bucket, or whole")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: the real)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--engine-raylet",
        choices=("own", "shared"),
        default="shared",
        help="the engine beside rank 0 (default), or on a raylet of its own (as on a node of "
        "its own: one more store-to-store copy per bucket, and more memory than 24 GB at 2x2)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=300,
        help="seconds to wait before each side for a quiet machine with the memory it needs",
    )
    parser.add_argument(
        "--retries", type=int, default=1, help="runs of a side that failed (memory, a crash)"
    )
    parser.add_argument("--no-ledger", action="store_true", help="times only, no counting")
    parser.add_argument("--sites", action="store_true", help="where the largest copies are")
    parser.add_argument("--keep", action="store_true", help="keep the ledger files")
    parser.add_argument("--verbose", action="store_true", help="the children's logs")
    parser.add_argument(
        "--verbose-failures", action="store_true", help="a failed child's last output"
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        child_main(args._child)
        return

    print(load_line("at start"), flush=True)
    from shapes import parameter_count

    pushed = parameter_count(args.layers) * 4  # float32, the CPU engines' dtype
    work = Path(tempfile.mkdtemp(prefix="rlx-bench-sync-"))
    results: dict[tuple, dict | None] = {}
    try:
        snapshot_harness(work)
        with worktree(args.baseline, "before") as base, worktree(args.after, "after") as then:
            sides = [("before", base)] if base is not None else []
            sides.append(("after" if base is not None else "current", then or REPO))
            model, data = write_inputs(work, args.layers, sides[-1][1])
            states = {name: tree_state(tree) for name, tree in sides}
            for name, _ in sides:
                print(f"{name}: {states[name]}", flush=True)
            for setup in args.setups:
                ranks, tp = (int(x) for x in setup.lower().split("x"))
                for bucket in args.buckets:
                    for name, tree in sides:
                        spec = {
                            "ranks": ranks,
                            "tp": tp,
                            "bucket": bucket,
                            "model": str(model),
                            "data": str(data),
                            "repeats": args.repeats,
                            "ledger": not args.no_ledger,
                            "verbose": args.verbose,
                            "engine_raylet": args.engine_raylet,
                        }
                        for attempt in range(args.retries + 1):
                            if attempt:
                                print("  again (a side that failed is retried)")
                            wait_for_room(tp, args.wait)
                            print(f"{setup} bucket {bucket} {name}: {load_line('now')}", flush=True)
                            result = run_child(tree, spec, work, args)
                            if result is not None:
                                break
                        if result is not None:
                            seen = ", ".join(
                                f"{role} {count}"
                                for role, count in sorted(result["seen"].items())
                                if count
                            )
                            counted = (
                                f"; {result['processes']} ledgers; events in the push "
                                f"windows: {seen or 'none'}"
                                if spec["ledger"]
                                else ""
                            )
                            print(
                                f"  {result['wall_s']:.0f} s; rlx from {result['rlx']}{counted}",
                                flush=True,
                            )
                            if spec["ledger"] and not result["ledger"]:
                                print("  WARNING: the ledger counted nothing for this side")
                        results[(setup, bucket, name)] = result
            end_states = {name: tree_state(tree) for name, tree in sides}
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"policy: Qwen2.5-0.5B shape, {args.layers} layers, {pushed / GB:.2f} GB per push "
        f"(float32); one vLLM engine (CPU build); {args.repeats} rounds, medians"
    )
    for name in states:
        changed = ""
        if end_states[name] != states[name]:
            changed = f"  CHANGED during the run: {end_states[name]}"
        print(f"{name}: {states[name]}{changed}")
    for setup in args.setups:
        ranks, tp = (int(x) for x in setup.lower().split("x"))
        for bucket in args.buckets:
            title = (
                f"{ranks} training rank{'s' if ranks > 1 else ''}"
                f"{' (FSDP)' if ranks > 1 else ''}, 1 engine of tp {tp}, bucket "
                f"{bucket if bucket == 'whole' else bucket + ' MiB'}"
            )
            side_results = [(name, results.get((setup, bucket, name))) for name in states]
            print_setting(title, side_results, pushed)
            if args.sites:
                for name, result in side_results:
                    if result is not None and result["ledger"]:
                        print_sites(name, result, pushed)
    print()
    print("(host copies: what the ledger sees, a floor; the wire is not a host copy: each socket")
    print(" byte is also copied twice by the kernel, which no Python hook sees)")
    print(load_line("at end"))


if __name__ == "__main__":
    main()
