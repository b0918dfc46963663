"""What a run leaves behind for people and for `rlx status`: result.json (state, exit code,
where things are, start and end reward) and the end-of-run figures behind the summary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlx.trainer.resolve import RESULT_FILE, RunPaths

# Steps averaged for the start and end reward of the summary (one step alone is noisy).
SUMMARY_WINDOW = 10


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


def finish(result: RunResult, paths: RunPaths) -> None:
    """The plot and the summary figures, from the metrics file."""
    from rlx.trainer.report.metrics import REWARD_MEAN, read_metrics
    from rlx.trainer.report.plots import summary, write_plot

    if paths.metrics.is_file():
        write_plot(paths.metrics, paths.plot)
    figures = summary(paths.metrics)
    result.first_reward = figures["first_reward_mean"]
    result.last_reward = figures["last_reward_mean"]
    result.wall_time_s = figures["wall_time_s"]
    if figures.get("val_steps") is not None:
        result.val_steps = list(figures["val_steps"])
        result.first_val_reward = figures["first_val_reward_mean"]
        result.last_val_reward = figures["last_val_reward_mean"]
        result.first_val_pass1 = figures["first_val_pass1"]
        result.last_val_pass1 = figures["last_val_pass1"]
    rewards = [
        r[REWARD_MEAN] for r in read_metrics(paths.metrics) if r.get(REWARD_MEAN) is not None
    ]
    if rewards:
        # Windows that never overlap: a short run compares its two halves.
        window = max(1, min(SUMMARY_WINDOW, len(rewards) // 2))
        result.reward_window = window
        result.first_reward_window = sum(rewards[:window]) / window
        result.last_reward_window = sum(rewards[-window:]) / window


def reward_summary(result: RunResult) -> str:
    """'0.080 -> 0.470 (mean of the first and last 10 steps)', or 'n/a'."""
    if result.first_reward_window is None or result.last_reward_window is None:
        return "n/a"
    window = result.reward_window or 1
    what = "first and last step" if window == 1 else f"mean of the first and last {window} steps"
    return f"{result.first_reward_window:.3f} -> {result.last_reward_window:.3f} ({what})"


def validation_lines(result: RunResult) -> list[str]:
    """'validation: reward 0.080 -> 0.450, pass@1 0.000 -> 0.500 (steps 0 and 80)'."""
    if result.val_steps is None:
        return []

    def change(first: float | None, last: float | None) -> str:
        if first is None or last is None:
            return "n/a"
        return f"{first:.3f} -> {last:.3f}"

    first, last = result.val_steps
    return [
        f"validation: reward {change(result.first_val_reward, result.last_val_reward)}, "
        f"pass@1 {change(result.first_val_pass1, result.last_val_pass1)} "
        f"(steps {first} and {last})"
    ]


def summary_lines(result: RunResult) -> list[str]:
    wall = "n/a" if result.wall_time_s is None else f"{result.wall_time_s:.1f} s"
    lines = [
        f"done: {result.last_step} of {result.steps} steps in {wall}",
        f"reward: {reward_summary(result)}",
        *validation_lines(result),
        f"metrics: {result.metrics}",
        f"reward plot: {result.plot}",
        f"log: {result.log}",
    ]
    if result.checkpoints:
        size = ""
        if result.checkpoint_bytes is not None:
            size = f" (last one {result.checkpoint_bytes / 2**20:.1f} MiB on disk)"
        lines.append(f"checkpoints: {result.checkpoints}{size}")
    if result.model:
        lines.append(f"model (Hugging Face folder): {result.model}")
    return lines
