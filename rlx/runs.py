"""The run folder, as the trainer writes it and `rlx status` / `rlx logs` read it, on the
head or on any machine that sees the folder (a local run, a Slurm job's shared filesystem).

One home for its file names, result.json (RunResult), the metrics reader, and the line
`rlx train` prints to name its run folder with the parser that finds it again in a log.
Light: no torch, no Ray.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlx.errors import first_line

# Where every run writes its outputs, inside the run folder.
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # per step: the prompt rows trained and their versions
LOG_FILE = "train.log"
PLOT_FILE = "reward.png"
RESULT_FILE = "result.json"
TENSORBOARD_DIR = "tensorboard"

# Metric names (keys of metrics.jsonl) that the console line, the plot, the summary and
# `rlx status` read. Any other name is logged all the same.
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
KL = "kl"
APPROX_KL = "approx_kl"
CLIPFRAC = "clipfrac"
ENTROPY = "entropy"
GRAD_NORM = "grad_norm"
RESPONSE_LENGTH = "response_length/mean"
TOKENS_PER_S = "tokens_per_s"
STEP_TIME = "step_time"
HOST_MEMORY = "host_memory_gib"  # host_memory_bytes() / 2**30
# Per step, over the training GPUs (none on CPU): the largest peak of memory allocated by
# torch since the step before and reserved by its allocator, the least free on the device.
GPU_PEAK = "gpu/peak_allocated_gib"
GPU_RESERVED = "gpu/reserved_gib"
GPU_FREE = "gpu/free_gib"
STALENESS = "staleness/mean"  # weight versions the trained samples lag the policy
IS_WEIGHT = "offpolicy/weight_mean"  # decoupled PPO's pi_proximal / pi_behaviour
IS_WEIGHT_STD = "offpolicy/weight_std"
IS_TRUNCATED = "offpolicy/truncated_frac"  # tokens whose weight hit behavior_weight_cap
# Where the engines' sampling log-probs (mu) reach the learner: how far they are from pi_old
# on the sampled tokens (algos/mismatch.py), and algo.rollout_correction's weight pi_old / mu.
MISMATCH_KL = "mismatch/kl"  # k3 estimate of KL(engine || learner), per token
MISMATCH_LOG_PPL = "mismatch/log_ppl_diff"  # learner minus engine log-perplexity
MISMATCH_MAX_LOGP = "mismatch/max_abs_logprob_diff"  # largest per-token gap
MISMATCH_LOGGED = (MISMATCH_KL, MISMATCH_LOG_PPL, MISMATCH_MAX_LOGP)
CORRECTION_WEIGHT = "mismatch/weight_mean"  # the raw weight before truncation or the mask
EPISODE_TURNS = "episode/turns"  # model turns per episode (trainer.environment)
EPISODE_TOOL_CALLS = "episode/tool_calls"  # per episode
EPISODE_TOOL_ERRORS = "episode/tool_errors"  # per episode
EPISODE_LENGTH = "episode/length"  # tokens after the prompt, the model's and the environment's
VAL_PASS1 = "val/pass@1"  # greedy answers' mean reward on the held-out prompts
CHECKPOINT_RETRIES = "checkpoint/retries"  # transient store errors retried, since the run began
VAL_REWARD = "val/reward_mean"  # mean reward of validation.n samples per held-out prompt
# Of the same validation.n samples per prompt (tasks/passk.py): pass@k for k = 1, 2, 4, ...
# <= n (pass@1 named apart from the greedy VAL_PASS1), avg@n, maj@n, the mean length.
VAL_PASS1_SAMPLED = "val/pass@1_sampled"
VAL_RESPONSE_LENGTH = "val/response_length"
VALIDATION_PREFIX = "val/"


def val_metric(name: str) -> str:
    """The val/* name of a tasks/passk.py summary key (pass@k, avg@n, maj@n,
    response_length)."""
    return VAL_PASS1_SAMPLED if name == "pass@1" else f"{VALIDATION_PREFIX}{name}"


def validation_metrics(n: int, compares_answers: bool) -> list[str]:
    """Every val/* metric a run logs with validation.n = n: greedy pass@1 and the mean
    reward, then the sampled figures (maj@n only where the reward compares answers)."""
    from rlx.trainer.tasks.passk import ks_up_to

    passes = [val_metric(f"pass@{k}") for k in ks_up_to(n)]
    majority = [val_metric(f"maj@{n}")] if compares_answers else []
    return [
        VAL_PASS1,
        VAL_REWARD,
        *passes,
        val_metric(f"avg@{n}"),
        *majority,
        VAL_RESPONSE_LENGTH,
    ]


# Steps averaged for the start and end reward of the summary (one step alone is noisy).
SUMMARY_WINDOW = 10


@dataclass(frozen=True)
class RunPaths:
    """Where one run reads and writes. checkpoints is None when checkpointing is off."""

    run_id: str
    run_dir: Path  # logging.dir / run id: metrics, log, plot, result (on this node's disk)
    checkpoint_root: Path | str | None  # checkpoint.dir, a folder or a store URL
    run_url: str | None = None  # logging.dir / run id in a store: run_dir is mirrored there

    @property
    def metrics(self) -> Path:
        return self.run_dir / METRICS_FILE

    @property
    def log(self) -> Path:
        return self.run_dir / LOG_FILE

    @property
    def plot(self) -> Path:
        return self.run_dir / PLOT_FILE

    @property
    def result(self) -> Path:
        return self.run_dir / RESULT_FILE

    @property
    def checkpoints(self) -> Path | str | None:
        if isinstance(self.checkpoint_root, str):
            return f"{self.checkpoint_root.rstrip('/')}/{self.run_id}"
        return None if self.checkpoint_root is None else self.checkpoint_root / self.run_id

    @property
    def where(self) -> str:
        """Where a user finds the run's files: the store prefix when mirrored there."""
        return self.run_url or str(self.run_dir)


# What `rlx launch` hands a job where it knows prices (--prices FILE, or SkyPilot's catalog):
# the cluster's price an hour, the accelerator alternative priced, whether that price is an
# upper bound (spot: auto, priced on-demand), and the launch's time. The run's result.json
# and summary carry the cost from them (run_cost), as `rlx status` computes it.
PRICE_ENV = "RLX_PRICE_PER_HOUR"
PRICE_LABEL_ENV = "RLX_PRICE_LABEL"
PRICE_AT_MOST_ENV = "RLX_PRICE_AT_MOST"
LAUNCHED_AT_ENV = "RLX_LAUNCHED_AT"


def run_cost(env: Mapping[str, str], started: float | None, ended: float) -> dict[str, Any] | None:
    """{per_hour, hours, dollars, at_most, label, since}: the price `env` carries times the
    hours from the launch (since "launch"; without its time, from this run's start, since
    "start") to `ended`; None where the launch carried no price."""
    try:
        per_hour = float(env[PRICE_ENV])
    except (KeyError, ValueError):
        return None
    since, origin = "launch", env.get(LAUNCHED_AT_ENV)
    try:
        begun = float(origin) if origin else None
    except ValueError:
        begun = None
    if begun is None:
        since, begun = "start", started
    if begun is None:
        return None
    hours = max(0.0, ended - begun) / 3600
    return {
        "per_hour": per_hour,
        "hours": hours,
        "dollars": per_hour * hours,
        "at_most": env.get(PRICE_AT_MOST_ENV) == "1",
        "label": env.get(PRICE_LABEL_ENV, ""),
        "since": since,
    }


def cost_line(cost: Mapping[str, Any]) -> str:
    """'cost: $12.40 (2.48 h since launch at $5.00/h, A100:8)'; '<=' for an upper bound."""
    bound = "<= " if cost["at_most"] else ""
    label = f", {cost['label']}" if cost["label"] else ""
    return (
        f"cost: {bound}${cost['dollars']:,.2f} ({cost['hours']:.2f} h since {cost['since']} "
        f"at {bound}${cost['per_hour']:,.2f}/h{label})"
    )


@dataclass
class RunResult:
    """What a finished (or failed) run leaves behind; also written as result.json."""

    state: str  # RUNNING | SUCCEEDED | FAILED | CANCELLED
    run_id: str
    run_dir: str
    steps: int
    last_step: int | None = None
    exit_code: int | None = None
    pid: int | None = None
    started: float | None = None
    finished: float | None = None
    wall_time_s: float | None = None
    first_reward: float | None = None  # reward/mean of the first step logged
    last_reward: float | None = None  # ... and of the last
    first_reward_window: float | None = None  # mean over the first SUMMARY_WINDOW steps
    last_reward_window: float | None = None  # ... and over the last ones: less noisy
    reward_window: int | None = None  # how many steps each of those means covers
    first_val_reward: float | None = None  # validation reward mean at its first step ...
    last_val_reward: float | None = None  # ... and at its last
    first_val_pass1: float | None = None  # validation greedy pass@1, first and last
    last_val_pass1: float | None = None
    val_steps: list[int] | None = None  # [first, last] step validated
    metrics: str | None = None
    plot: str | None = None
    log: str | None = None
    checkpoints: str | None = None
    checkpoint_bytes: int | None = None  # size on disk of the last checkpoint saved
    # checkpoint.best's step: {metric, mode, step, value, checkpoint}; None when unset or
    # while no validated step is saved
    best: dict[str, Any] | None = None
    gpu_peak_gib: float | None = None  # the largest GPU_PEAK of the run (GPU runs)
    plan_gpu_gib: float | None = None  # what `rlx plan` gives a training GPU at its peak
    # the accelerator the job got (alternative, device, memory, count, cloud, region, spot)
    # and the sizes `auto` chose for it
    accelerator: dict[str, Any] | None = None
    model: str | None = None  # the Hugging Face folder exported at the end
    error: str | None = None
    cost: dict[str, Any] | None = None  # run_cost: where the launch knew prices


def write_result(paths: RunPaths, result: RunResult) -> None:
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    temporary = paths.result.with_name(f".{paths.result.name}.tmp")
    temporary.write_text(json.dumps(asdict(result), indent=1))
    temporary.replace(paths.result)


def read_result(run_dir: Path) -> RunResult | None:
    try:
        return RunResult(**json.loads((run_dir / RESULT_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------- metrics


def read_metrics(jsonl_path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file in order; a torn last line (a crash mid-write) is skipped."""
    return [record for _, record in metric_lines(Path(jsonl_path))]


def metric_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append((line, record))
    return records


# --------------------------------------------------------------------------- the run line

# What `rlx train` prints on the head once it knows its run folder, and how a log is read.
RUN_LINE_FORMAT = "rlx train: run {run_id}, outputs in {run_dir}"
RUN_LINE = re.compile(
    re.escape(RUN_LINE_FORMAT)
    .replace(re.escape("{run_id}"), r"(\S+)")
    .replace(re.escape("{run_dir}"), r"(.+?)")
    + r"\s*$",
    re.MULTILINE,
)


def run_line(paths: RunPaths) -> str:
    return RUN_LINE_FORMAT.format(run_id=paths.run_id, run_dir=paths.run_dir)


def run_dir_from_log(text: str) -> Path | None:
    """The newest run folder a head log names (a requeued job names one per attempt)."""
    found = RUN_LINE.findall(text)
    return Path(found[-1][1]) if found else None


# --------------------------------------------------------------------------- progress


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_detail(run_dir: Path, now: float | None = None) -> str | None:
    """'step 12 of 100, reward 0.412, 3m05s elapsed, ETA 22m40s, newest checkpoint
    s3://b/ckpt/run/step-000010'; None without a record. The checkpoint is read where it
    lives (a folder, or a store when its library and credentials are here)."""
    record = read_result(run_dir)
    if record is None:
        return None
    rows = read_metrics(run_dir / METRICS_FILE)
    step = rows[-1]["step"] if rows else 0
    parts = [f"step {step} of {record.steps}"]
    reward = next((r[REWARD_MEAN] for r in reversed(rows) if REWARD_MEAN in r), None)
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if record.started is not None:
        end = record.finished if record.finished else (now or time.time())
        elapsed = end - record.started
        parts.append(f"{_duration(elapsed)} elapsed")
        if record.state == "RUNNING" and rows and step > 0:
            # At the pace of the steps the metrics file holds since its first one.
            done = step - rows[0]["step"] + 1
            rate = elapsed / max(done, 1)
            parts.append(f"ETA {_duration(rate * (record.steps - step))}")
    if record.checkpoints:
        from rlx.checkpoints import newest_complete_step

        newest = newest_complete_step(record.checkpoints)
        parts.append(f"newest checkpoint {newest}" if newest else "no checkpoint yet")
    return ", ".join(parts)


# --------------------------------------------------------------------------- runs in a store


def pull_run(paths: RunPaths) -> int:
    """A run folder mirrored to a store (logging.dir is a URL): bring back what an earlier
    attempt of this run left there (its metrics, log, TensorBoard events), so a resumed run
    on another machine continues the same files. Returns the files fetched."""
    if paths.run_url is None:
        return 0
    from rlx.storage import filesystem

    fs, base = filesystem(paths.run_url)
    fs.invalidate_cache(base)
    try:
        names = [p[len(base) + 1 :] for p in fs.find(base)]
    except FileNotFoundError:
        return 0
    # The exported model is rewritten at the end; the rest continues where it stopped.
    names = [n for n in names if not n.startswith("model/")]
    local = [paths.run_dir / n for n in names]
    missing = [(n, p) for n, p in zip(names, local, strict=True) if not p.exists()]
    for _, path in missing:
        path.parent.mkdir(parents=True, exist_ok=True)
    if missing:
        fs.get([f"{base}/{n}" for n, _ in missing], [str(p) for _, p in missing])
    return len(missing)


# What push_run sent of each run folder: file -> (size, mtime) at the time.
_PUSHED: dict[Path, dict[Path, tuple[int, int]]] = {}


def push_run(paths: RunPaths) -> None:
    """Copy the run folder to its store prefix (logging.dir is a URL): called after every
    checkpoint and when the run ends, so what a preempted node held is in the store. Only
    files new or changed since this process last pushed them are sent."""
    if paths.run_url is None or not paths.run_dir.is_dir():
        return
    from rlx.storage import filesystem

    fs, base = filesystem(paths.run_url)
    sent = _PUSHED.setdefault(paths.run_dir, {})
    files, seen = [], {}
    for path in sorted(paths.run_dir.rglob("*")):
        if path.is_file():
            stat = path.stat()
            seen[path] = (stat.st_size, stat.st_mtime_ns)
            if sent.get(path) != seen[path]:  # new or changed since the last push
                files.append(path)
    names = [p.relative_to(paths.run_dir).as_posix() for p in files]
    if files:
        fs.put([str(p) for p in files], [f"{base}/{n}" for n in names])
    sent.update({path: seen[path] for path in files})


def mirror_run(paths: RunPaths, err: Any) -> None:
    """push_run, where a failure to reach the store is a warning on err: the run's own
    outcome (and its checkpoints, which have their own checks) stands."""
    try:
        push_run(paths)
    except Exception as exc:  # the store's library raises its own kinds
        first = first_line(exc)
        print(f"warning: run folder not copied to {paths.run_url}: {first}", file=err)
