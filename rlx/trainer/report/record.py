"""The end of a run for people: the plot, the figures of result.json's summary (start and end
reward, validation), and the summary lines. (result.json itself: rlx/runs.py.)"""

from __future__ import annotations

from rlx.runs import SUMMARY_WINDOW, RunPaths, RunResult, cost_line


def finish(result: RunResult, paths: RunPaths) -> None:
    """The plot and the summary figures, from the metrics file."""
    from rlx.runs import GPU_PEAK, REWARD_MEAN, read_metrics
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
    records = read_metrics(paths.metrics)
    rewards = [r[REWARD_MEAN] for r in records if r.get(REWARD_MEAN) is not None]
    peaks = [r[GPU_PEAK] for r in records if r.get(GPU_PEAK) is not None]
    if peaks:
        result.gpu_peak_gib = max(peaks)
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


def best_summary(best: dict) -> str:
    """'val/avg@4 0.412 at step 6 (max), runs/ckpt/run/step-000006' (result.json's best)."""
    return (
        f"{best['metric']} {best['value']:.4g} at step {best['step']} ({best['mode']}), "
        f"{best['checkpoint']}"
    )


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
    if result.accelerator:
        lines.insert(1, result.accelerator["line"])
    if result.checkpoints:
        size = ""
        if result.checkpoint_bytes is not None:
            size = f" (last one {result.checkpoint_bytes / 2**20:.1f} MiB on disk)"
        lines.append(f"checkpoints: {result.checkpoints}{size}")
    if result.best:
        lines.append(f"best checkpoint: {best_summary(result.best)}")
    if result.model:
        lines.append(f"model (Hugging Face folder): {result.model}")
    if result.cost is not None:
        lines.append(cost_line(result.cost))
    if result.gpu_peak_gib is not None:
        plan = "n/a" if result.plan_gpu_gib is None else f"{result.plan_gpu_gib:.1f} GiB"
        lines.append(
            f"GPU memory: at most {result.gpu_peak_gib:.1f} GiB allocated on a training GPU "
            f"(rlx plan: {plan} at its peak)"
        )
    return lines
