"""Per-step training metrics, written to every sink that is on: a jsonl file, TensorBoard,
W&B and a compact console line; plus the host memory figure the loop reports each step.

The jsonl file is the record the others can be rebuilt from: one JSON object per step
({"step": ..., "time": ..., <metrics>}), flushed at each line so a crash loses nothing
already logged. Non-finite values are written as null there (strict JSON), as NaN elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TextIO

from rlx import procfs
from rlx.runs import (
    APPROX_KL,
    CLIPFRAC,
    ENTROPY,
    EPISODE_LENGTH,
    EPISODE_TOOL_CALLS,
    EPISODE_TOOL_ERRORS,
    EPISODE_TURNS,
    GRAD_NORM,
    HOST_MEMORY,
    IS_TRUNCATED,
    IS_WEIGHT,
    IS_WEIGHT_STD,
    KL,
    METRICS_FILE,
    MISMATCH_KL,
    RESPONSE_LENGTH,
    REWARD_MEAN,
    REWARD_STD,
    STALENESS,
    STEP_TIME,
    TENSORBOARD_DIR,
    TOKENS_PER_S,
    VAL_PASS1,
    VAL_REWARD,
    metric_lines,
)

RESERVED_KEYS = frozenset({"step", "time"})
WANDB_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Column:
    """One field of the console line: `label value`, shown only when the key was logged."""

    label: str
    key: str
    fmt: str
    spread_key: str | None = None  # printed as value±spread when logged
    unit: str = ""


CONSOLE_COLUMNS: tuple[Column, ...] = (
    Column("reward", REWARD_MEAN, ".3f", spread_key=REWARD_STD),
    Column("val", VAL_REWARD, ".3f"),
    Column("pass@1", VAL_PASS1, ".3f"),
    Column("kl", KL, ".4f"),
    Column("approx_kl", APPROX_KL, ".4f"),
    Column("clipfrac", CLIPFRAC, ".3f"),
    Column("stale", STALENESS, ".2f"),
    Column("isw", IS_WEIGHT, ".2f", spread_key=IS_WEIGHT_STD),
    Column("trunc", IS_TRUNCATED, ".3f"),
    Column("mismatch", MISMATCH_KL, ".2e"),
    Column("entropy", ENTROPY, ".3f"),
    Column("grad", GRAD_NORM, ".3g"),
    Column("len", RESPONSE_LENGTH, ".1f"),
    Column("turns", EPISODE_TURNS, ".2f"),
    Column("calls", EPISODE_TOOL_CALLS, ".2f"),
    Column("tool_err", EPISODE_TOOL_ERRORS, ".2f"),
    Column("ep_len", EPISODE_LENGTH, ".1f"),
    Column("tok/s", TOKENS_PER_S, ".0f"),
    Column("mem", HOST_MEMORY, ".1f", unit="G"),
    Column("time", STEP_TIME, ".2f", unit="s"),
)


def format_console_line(
    step: int, metrics: Mapping[str, float], columns: tuple[Column, ...] = CONSOLE_COLUMNS
) -> str:
    fields = [f"step {step}"]
    for column in columns:
        if column.key not in metrics:
            continue
        text = format(metrics[column.key], column.fmt)
        if column.spread_key is not None and column.spread_key in metrics:
            text += "±" + format(metrics[column.spread_key], column.fmt)
        fields.append(f"{column.label} {text}{column.unit}")
    return "  ".join(fields)


# --------------------------------------------------------------------------- reading


# --------------------------------------------------------------------------- sinks


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None: ...

    def close(self) -> None: ...


class StepRecords:
    """A jsonl file of one record per step, flushed at once. On resume, lines at or past
    start_step are dropped first (they are about to be written again), so the file never holds
    a step twice and always tells the history of the checkpoints' lineage."""

    def __init__(self, path: Path, start_step: int):
        kept = [line for line, record in metric_lines(path) if record["step"] < start_step]
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in kept)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open until close()

    def write(self, step: int, **fields: Any) -> None:
        self._file.write(json.dumps({"step": step, **fields}, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class JsonlSink(StepRecords):
    """The metrics: {"step", "time", <metrics>} per step; non-finite values as null."""

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        record: dict[str, Any] = {"step": step, "time": round(wall_time, 3)}
        record.update(
            {key: value if math.isfinite(value) else None for key, value in metrics.items()}
        )
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()


class TensorBoardSink:
    def __init__(self, log_dir: Path, start_step: int, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events at or past it left by the run before the restart.
        self._writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=start_step if start_step > 0 else None
        )
        text = json.dumps(config, indent=1, sort_keys=True, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", global_step=start_step)

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run keyed by the run name, so a relaunched job continues the same run.

    W&B ignores steps below the last one it holds, so after a resume the steps redone since
    the checkpoint are missing there until the run catches up (jsonl and TensorBoard keep them).
    """

    def __init__(self, run: Any, note: Callable[[str], None]):
        self._run = run
        self._note = note

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self._run is None:
            return
        try:
            self._run.log(dict(metrics), step=step)
        except Exception as error:  # a W&B outage must not stop training
            self._note(f"W&B: logging failed ({type(error).__name__}); W&B is off from here on")
            self._run = None

    def close(self) -> None:
        if self._run is None:
            return
        try:
            self._run.finish()
        except Exception as error:  # the metrics file still has everything
            self._note(f"W&B: finishing the run failed ({type(error).__name__})")
        self._run = None


def open_wandb(
    project: str | None,
    run_name: str,
    config: Mapping[str, Any],
    env: Mapping[str, str],
    note: Callable[[str], None],
) -> WandbSink | None:
    """A W&B sink when a project is set, WANDB_API_KEY is set and wandb imports; else a note.

    The key's value is never printed: error texts have it masked before they are shown.
    """
    if not project:
        return None
    key = env.get("WANDB_API_KEY", "")
    if not key:
        note("W&B: wandb_project is set but WANDB_API_KEY is not; not logging to W&B")
        return None
    try:
        import wandb
    except ImportError:
        note("W&B: the wandb package is not installed (pip install 'rlx[wandb]'); not logging")
        return None
    except Exception as error:  # a broken install (e.g. clashing protobuf) is not fatal
        note(f"W&B: importing wandb failed ({type(error).__name__}); not logging to W&B")
        return None
    run_id = WANDB_ID_CHARS.sub("-", run_name)[:64] or "rlx"
    try:
        run = wandb.init(
            project=project, name=run_name, id=run_id, resume="allow", config=dict(config)
        )
    except Exception as error:
        text = str(error).replace(key, "***")
        reason = text.splitlines()[0] if text else ""
        note(f"W&B: could not start a run ({type(error).__name__}: {reason}); not logging")
        return None
    return WandbSink(run, note)


class ConsoleSink:
    def __init__(self, stream: TextIO, every: int):
        self._stream = stream
        self._every = every

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if step % self._every == 0:
            print(format_console_line(step, metrics), file=self._stream, flush=True)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the logger


def _as_float(key: str, value: Any) -> float:
    try:
        return float(value)  # also 0-d tensors and numpy scalars
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"metric {key!r}: {type(value).__name__} is not a number") from error


class MetricsLogger:
    """Fans each step's metrics out to the jsonl file, TensorBoard, W&B and the console.

    run_dir gets metrics.jsonl and tensorboard/. start_step is the first step this process
    will log: a resumed run passes the step it resumes at, and anything logged before at or
    past that step is dropped (jsonl) or hidden (TensorBoard). W&B is used only when
    wandb_project is set, WANDB_API_KEY is in env (os.environ by default) and wandb imports;
    otherwise one note says why. Notes and console lines go to stream (stdout by default).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        wandb_project: str | None,
        run_name: str,
        config: Mapping[str, Any],
        console_every: int = 1,
        start_step: int = 0,
        env: Mapping[str, str] | None = None,
        stream: TextIO | None = None,
    ):
        if console_every < 1:
            raise ValueError(f"console_every must be at least 1, got {console_every}")
        self.run_dir = Path(run_dir)
        self._stream = stream if stream is not None else sys.stdout
        self._sinks: list[Sink] = [JsonlSink(self.jsonl_path, start_step)]
        if tensorboard:
            try:
                self._sinks.append(
                    TensorBoardSink(self.run_dir / TENSORBOARD_DIR, start_step, config)
                )
            except ImportError:
                self.note("TensorBoard: tensorboard is not installed; not writing event files")
        wandb_sink = open_wandb(
            wandb_project, run_name, config, os.environ if env is None else env, self.note
        )
        if wandb_sink is not None:
            self._sinks.append(wandb_sink)
        self._sinks.append(ConsoleSink(self._stream, console_every))

    @property
    def jsonl_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def note(self, message: str) -> None:
        print(f"note: {message}", file=self._stream, flush=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        clash = RESERVED_KEYS.intersection(metrics)
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved by the metrics file")
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        wall_time = time.time()
        for sink in self._sinks:
            sink.log(step, values, wall_time)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- host memory


def host_memory_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default) and all its descendants, in bytes.

    Ray worker processes count when the Ray cluster was started from this process; workers
    of a cluster started with `ray start` are children of its raylet, not of the driver.
    Shared pages count once per process that maps them, so this is an upper bound.
    """
    root = os.getpid() if pid is None else pid
    try:
        import psutil
    except ImportError:
        return procfs.tree_rss_bytes(root)
    return _tree_rss_psutil(psutil, root)


def _tree_rss_psutil(psutil: Any, root: int) -> int:
    process = psutil.Process(root)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone since listing, or not ours to read
    return total
