"""End-of-run views of a metrics file: a two-panel PNG and a short summary for the CLI."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from rlx.runs import (
    APPROX_KL,
    ENTROPY,
    KL,
    MISMATCH_KL,
    REWARD_MEAN,
    REWARD_STD,
    STALENESS,
    STEP_TIME,
    VAL_PASS1,
    VAL_REWARD,
    read_metrics,
)

VALIDATION_SERIES = ((VAL_REWARD, "validation reward mean"), (VAL_PASS1, "validation pass@1"))
# validation.n > 1 samples a prompt: val/pass@k for k = 2, 4, ... <= n, and val/maj@n
SAMPLED = re.compile(r"val/(pass|maj)@(\d+)")


def validation_series(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(key, label) of the validation lines: the reward mean and the greedy pass@1, then
    where validation samples, the largest k's pass@k and maj@n (the figures `rlx eval`
    reports for the same samples)."""
    largest: dict[str, int] = {}
    for record in records:
        for key in record:
            if (match := SAMPLED.fullmatch(key)) and int(match[2]) > 1:
                largest[match[1]] = max(largest.get(match[1], 0), int(match[2]))
    sampled = [
        (f"val/{kind}@{largest[kind]}", f"validation {kind}@{largest[kind]}")
        for kind in ("pass", "maj")
        if kind in largest
    ]
    return [*VALIDATION_SERIES, *sampled]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where key holds a finite number; missing, null and NaN are skipped."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def write_plot(jsonl_path: Path, png_path: Path) -> Path:
    """Two stacked panels: the training reward mean (with a ±std band when logged) and the
    validation scores when logged; below, what the upper panel does not show (second_panel):
    KL or entropy, and the samples' staleness when rollouts run ahead."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(Path(jsonl_path))
    figure = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(figure)  # Agg directly: no pyplot, no global backend switch
    reward_axes, kl_axes = figure.subplots(2, 1, sharex=True)
    _reward_panel(reward_axes, records)
    _lower_panel(kl_axes, records)

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = png_path.with_name(f".{png_path.name}.tmp")
    figure.savefig(temporary, format="png", dpi=100)
    temporary.replace(png_path)
    return png_path


def _reward_panel(reward_axes: Any, records: list[dict[str, Any]]) -> None:
    """The training reward mean with its ±std band, and the validation scores."""
    # Markers keep a run of one or two steps visible, where a line alone would not be.
    steps, means = _series(records, REWARD_MEAN)
    if steps:
        reward_axes.plot(steps, means, marker="o", markersize=3, label="reward mean")
        std_by_step = dict(zip(*_series(records, REWARD_STD), strict=True))
        band = [
            (s, m, std_by_step[s]) for s, m in zip(steps, means, strict=True) if s in std_by_step
        ]
        if band:
            reward_axes.fill_between(
                [s for s, _, _ in band],
                [m - d for _, m, d in band],
                [m + d for _, m, d in band],
                alpha=0.25,
                label="±1 std",
            )
    validation = [(label, *_series(records, key)) for key, label in validation_series(records)]
    validation = [(label, steps, values) for label, steps, values in validation if steps]
    for label, val_steps, values in validation:
        reward_axes.plot(val_steps, values, marker="s", markersize=4, linestyle="--", label=label)
    if steps or validation:
        reward_axes.legend(loc="best")
    else:
        _no_data(reward_axes)
    reward_axes.set_ylabel("reward")
    reward_axes.grid(alpha=0.3)


def _lower_panel(kl_axes: Any, records: list[dict[str, Any]]) -> None:
    """second_panel's lines, the staleness on an axis of its own on the right."""
    ylabel, lines, right = second_panel(records)
    for label, line_steps, values in lines:
        kl_axes.plot(line_steps, values, marker="o", markersize=3, label=label)
    handles, labels = kl_axes.get_legend_handles_labels()
    if right is not None:
        lag_axes = kl_axes.twinx()
        for label, line_steps, values in right[1]:
            lag_axes.plot(line_steps, values, color="tab:red", drawstyle="steps-mid", label=label)
        lag_axes.set_ylabel(right[0])
        more_handles, more_labels = lag_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        kl_axes.legend(handles, labels, loc="best")
    else:
        _no_data(kl_axes)
    kl_axes.set_ylabel(ylabel)
    kl_axes.set_xlabel("step")
    kl_axes.grid(alpha=0.3)


Lines = list[tuple[str, list[int], list[float]]]


def second_panel(records: list[dict[str, Any]]) -> tuple[str, Lines, tuple[str, Lines] | None]:
    """What the lower panel shows that the upper does not: (y label, lines) on the left axis,
    and (y label, lines) on a right axis or None. Left: the KL to the reference when there is
    one, else the update's approx KL where it is not all zero (one update per step makes it
    exactly 0), else the policy's entropy. Right: how many weight versions the trained
    samples lag the policy, when rollouts run ahead (max_staleness > 0), else the engines'
    mismatch to the learner (mismatch/kl) where it was measured."""
    left: tuple[str, Lines] = ("KL", [])
    steps, values = _series(records, KL)
    if steps:
        left = ("KL", [("KL to reference", steps, values)])
    elif any((approx := _series(records, APPROX_KL))[1]):
        left = ("KL", [("approx KL (policy update)", *approx)])
    elif (entropy := _series(records, ENTROPY))[0]:
        left = ("entropy", [("policy entropy", *entropy)])
    right = None
    lag_steps, lags = _series(records, STALENESS)
    if lag_steps:
        right = ("staleness (versions)", [("sample staleness, mean", lag_steps, lags)])
    elif (mismatch := _series(records, MISMATCH_KL))[0]:
        right = ("engine mismatch", [("k3 KL(engine || learner)", *mismatch)])
    return left[0], left[1], right


def _no_data(axes: Any) -> None:
    axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center")


def summary(jsonl_path: Path) -> dict[str, Any]:
    """Steps logged, first/last step, first/last reward mean and wall time (None if unknown).

    Wall time runs from the start of the first logged step (its end minus its step_time,
    when logged) to the end of the last, so a resumed run's pause is included.
    """
    records = read_metrics(Path(jsonl_path))
    result: dict[str, Any] = {
        "steps": len(records),
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "first_reward_mean": None,
        "last_reward_mean": None,
        "wall_time_s": None,
    }
    _, rewards = _series(records, REWARD_MEAN)
    if rewards:
        result["first_reward_mean"] = rewards[0]
        result["last_reward_mean"] = rewards[-1]
    for key, name in ((VAL_REWARD, "reward_mean"), (VAL_PASS1, "pass1")):
        val_steps, values = _series(records, key)
        result[f"first_val_{name}"] = values[0] if values else None
        result[f"last_val_{name}"] = values[-1] if values else None
        if values:
            result["val_steps"] = (val_steps[0], val_steps[-1])
    times = [r["time"] for r in records if isinstance(r.get("time"), int | float)]
    if times:
        first_step_time = records[0].get(STEP_TIME)
        lead = first_step_time if isinstance(first_step_time, int | float) else 0.0
        result["wall_time_s"] = max(times) - min(times) + lead
    return result
