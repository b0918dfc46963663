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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Where every run writes its outputs, inside the run folder.
METRICS_FILE = "metrics.jsonl"
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
VAL_PASS1 = "val/pass@1"  # greedy answers' mean reward on the held-out prompts
VAL_REWARD = "val/reward_mean"  # mean reward of validation.n samples per held-out prompt

# Steps averaged for the start and end reward of the summary (one step alone is noisy).
SUMMARY_WINDOW = 10


@dataclass(frozen=True)
class RunPaths:
    """Where one run reads and writes. checkpoints is None when checkpointing is off."""

    run_id: str
    run_dir: Path  # logging.dir / run id: metrics, log, plot, result
    checkpoint_root: Path | None  # checkpoint.dir (the manager adds the run id)

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
    def checkpoints(self) -> Path | None:
        return None if self.checkpoint_root is None else self.checkpoint_root / self.run_id


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
    model: str | None = None  # the Hugging Face folder exported at the end
    error: str | None = None


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
    """'step 12 of 100, reward 0.412, 3m05s elapsed, ETA 22m40s'; None without a record."""
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
    return ", ".join(parts)
