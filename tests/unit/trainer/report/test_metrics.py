"""Metrics sinks, resume de-duplication, host memory, the plot, the summary and progress."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rlx.runs import METRICS_FILE, TENSORBOARD_DIR, read_metrics
from rlx.trainer.report.metrics import MetricsLogger, format_console_line
from rlx.trainer.report.plots import second_panel, summary, write_plot
from rlx.trainer.report.progress import Progress, track

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_logger(run_dir: Path, **overrides: object) -> tuple[MetricsLogger, io.StringIO]:
    stream = io.StringIO()
    options: dict[str, object] = {
        "tensorboard": False,
        "wandb_project": None,
        "run_name": "test-run",
        "config": {"lr": 1e-6},
        "env": {},
        "stream": stream,
    }
    options.update(overrides)
    return MetricsLogger(run_dir, **options), stream  # type: ignore[arg-type]


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step,
        "reward/std": 0.05,
        "kl": 0.001 * step,
        "approx_kl": 0.0005,
        "step_time": 2.0,
    }


# --------------------------------------------------------------------------- jsonl


def test_jsonl_has_one_flushed_object_per_step(tmp_path: Path) -> None:
    logger, _ = make_logger(tmp_path)
    logger.log(0, {"reward/mean": 0.5, "loss": torch.tensor(1.5), "flag": True})
    # Flushed at once: readable before close.
    records = read_metrics(tmp_path / METRICS_FILE)
    assert len(records) == 1
    assert records[0]["step"] == 0
    assert records[0]["reward/mean"] == 0.5
    assert records[0]["loss"] == 1.5
    assert records[0]["flag"] == 1.0
    assert isinstance(records[0]["time"], float)
    logger.log(1, {"reward/mean": math.nan, "kl": math.inf})
    logger.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2
    # Strict JSON: non-finite values become null rather than the NaN extension.
    second = json.loads(lines[1], parse_constant=lambda name: pytest.fail(name))
    assert second["reward/mean"] is None and second["kl"] is None


def test_resume_drops_steps_at_or_past_the_resumed_step(tmp_path: Path) -> None:
    with make_logger(tmp_path)[0] as logger:
        for step in range(6):
            logger.log(step, step_metrics(step))
    with (tmp_path / METRICS_FILE).open("a") as handle:
        handle.write('{"step": 6, "rew')  # torn by a crash mid-line
    with make_logger(tmp_path, start_step=4)[0] as logger:
        for step in range(4, 8):
            logger.log(step, {**step_metrics(step), "resumed": 1.0})
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(8))
    assert [("resumed" in r) for r in records] == [False] * 4 + [True] * 4
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 8


def test_a_fresh_start_replaces_an_old_file(tmp_path: Path) -> None:
    with make_logger(tmp_path)[0] as logger:
        logger.log(0, {"a": 1.0})
        logger.log(1, {"a": 2.0})
    with make_logger(tmp_path)[0] as logger:
        logger.log(0, {"a": 3.0})
    assert [r["a"] for r in read_metrics(tmp_path / METRICS_FILE)] == [3.0]


def test_bad_values_and_reserved_names_are_refused(tmp_path: Path) -> None:
    with make_logger(tmp_path)[0] as logger:
        with pytest.raises(TypeError, match=r"'loss'.*Tensor"):
            logger.log(0, {"loss": torch.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(0, {"step": 1.0})


# --------------------------------------------------------------------------- console


def test_console_line_has_the_key_numbers_and_respects_every(tmp_path: Path) -> None:
    logger, stream = make_logger(tmp_path, console_every=2)
    for step in range(1, 5):
        logger.log(
            step,
            {
                **step_metrics(step),
                "clipfrac": 0.125,
                "entropy": math.nan,
                "grad_norm": 0.75,
                "response_length/mean": 42.0,
                "tokens_per_s": 1234.4,
                "host_memory_gib": 3.25,
            },
        )
    logger.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 2", "step 4"]
    assert lines[1] == (
        "step 4  reward 0.400±0.050  kl 0.0040  approx_kl 0.0005  clipfrac 0.125  "
        "entropy nan  grad 0.75  len 42.0  tok/s 1234  mem 3.2G  time 2.00s"
    )


def test_console_line_skips_missing_keys() -> None:
    assert format_console_line(7, {"kl": 0.5, "other": 1.0}) == "step 7  kl 0.5000"


# --------------------------------------------------------------------------- tensorboard


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_events_are_written_readable_and_purged_on_resume(tmp_path: Path) -> None:
    with make_logger(tmp_path, tensorboard=True)[0] as logger:
        for step in range(5):
            logger.log(step, {"reward/mean": float(step), "kl": math.nan})
    log_dir = tmp_path / TENSORBOARD_DIR
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())
    assert scalars(log_dir, "reward/mean") == [(s, float(s)) for s in range(5)]
    assert all(math.isnan(value) for _, value in scalars(log_dir, "kl"))

    with make_logger(tmp_path, tensorboard=True, start_step=3)[0] as logger:
        for step in range(3, 6):
            logger.log(step, {"reward/mean": 10.0 + step, "kl": 0.0})
    assert scalars(log_dir, "reward/mean") == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]


# --------------------------------------------------------------------------- W&B


SECRET = "wandb-key-must-never-appear-1234567890"


def all_written_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def test_wandb_without_the_package_is_one_note_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    logger, stream = make_logger(
        tmp_path, wandb_project="rlx-tests", env={"WANDB_API_KEY": SECRET}, tensorboard=True
    )
    logger.log(0, {"reward/mean": 1.0})
    logger.close()
    output = stream.getvalue()
    assert output.count("note: W&B") == 1
    assert "not installed" in output
    assert SECRET not in output
    assert SECRET not in all_written_text(tmp_path)


def test_wandb_without_a_key_is_one_note(tmp_path: Path) -> None:
    logger, stream = make_logger(tmp_path, wandb_project="rlx-tests", env={})
    logger.log(0, {"reward/mean": 1.0})
    logger.close()
    notes = [line for line in stream.getvalue().splitlines() if line.startswith("note:")]
    assert notes == ["note: W&B: wandb_project is set but WANDB_API_KEY is not; not logging to W&B"]


def test_no_wandb_project_means_no_note(tmp_path: Path) -> None:
    logger, stream = make_logger(tmp_path, env={"WANDB_API_KEY": SECRET})
    logger.log(0, {"reward/mean": 1.0})
    logger.close()
    assert "note:" not in stream.getvalue()
    assert SECRET not in stream.getvalue()


# --------------------------------------------------------------------------- host memory


# --------------------------------------------------------------------------- plot, summary


def write_steps(run_dir: Path, count: int, *, with_std: bool = True) -> Path:
    with make_logger(run_dir)[0] as logger:
        for step in range(count):
            values = step_metrics(step)
            if not with_std:
                del values["reward/std"]
            logger.log(step, values)
    return run_dir / METRICS_FILE


@pytest.mark.parametrize("count", [1, 20])
def test_plot_is_a_png(tmp_path: Path, count: int) -> None:
    png = write_plot(write_steps(tmp_path, count), tmp_path / "plots" / "metrics.png")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not any(p.name.startswith(".") for p in png.parent.iterdir())


def test_plot_copes_with_missing_keys_and_nan(tmp_path: Path) -> None:
    with make_logger(tmp_path)[0] as logger:
        logger.log(0, {"loss": 1.0})
        logger.log(1, {"reward/mean": math.nan})
    png = write_plot(tmp_path / METRICS_FILE, tmp_path / "metrics.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    missing = write_plot(tmp_path / "absent.jsonl", tmp_path / "empty.png")
    assert missing.read_bytes().startswith(PNG_MAGIC)


def test_summary(tmp_path: Path) -> None:
    result = summary(write_steps(tmp_path, 20, with_std=False))
    assert result["steps"] == 20
    assert (result["first_step"], result["last_step"]) == (0, 19)
    assert result["first_reward_mean"] == 0.0
    assert result["last_reward_mean"] == pytest.approx(1.9)
    assert 2.0 <= result["wall_time_s"] < 60.0  # includes the first step's own 2 s
    assert summary(tmp_path / "absent.jsonl") == {
        "steps": 0,
        "first_step": None,
        "last_step": None,
        "first_reward_mean": None,
        "last_reward_mean": None,
        "first_val_reward_mean": None,
        "last_val_reward_mean": None,
        "first_val_pass1": None,
        "last_val_pass1": None,
        "wall_time_s": None,
    }


# --------------------------------------------------------------------------- progress


def test_progress_off_a_terminal_prints_a_few_lines() -> None:
    stream = io.StringIO()
    seen = list(track(range(10), "rollouts", stream=stream))
    assert seen == list(range(10))
    lines = stream.getvalue().splitlines()
    assert lines[:-1] == ["rollouts: 3/10", "rollouts: 6/10", "rollouts: 9/10"]
    assert lines[-1].startswith("rollouts: 10/10 in ") and lines[-1].endswith("s")


def test_progress_without_a_total_reports_at_close() -> None:
    stream = io.StringIO()
    with Progress(None, "steps", stream=stream) as progress:
        progress.update(5)
        progress.update(2)
    assert stream.getvalue().startswith("steps: 7 in ")
    assert len(stream.getvalue().splitlines()) == 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_draws_a_bar_instead_of_lines() -> None:
    stream = Terminal()
    assert list(track([1, 2, 3], "rollouts", stream=stream)) == [1, 2, 3]
    output = stream.getvalue()
    assert "\r" in output and "0/3" in output  # tqdm throttles redraws; the bar clears
    assert "rollouts: 3/3 in" not in output


def test_the_lower_panel_shows_what_the_upper_does_not() -> None:
    val = [{"step": 0, "val/reward_mean": 0.1, "val/pass@1": 0.0}]
    steps = [{"step": s, "reward/mean": 0.2, "approx_kl": 0.0, "entropy": 2.5} for s in (1, 2)]
    val.append({"step": 2, "val/reward_mean": 0.4, "val/pass@1": 0.5})
    # Validation is in the upper panel: never repeated below. approx_kl all 0: entropy.
    assert second_panel(steps + val) == ("entropy", [("policy entropy", [1, 2], [2.5, 2.5])], None)
    with_kl = [{**record, "kl": 0.01} for record in steps]
    assert second_panel(with_kl + val)[:2] == ("KL", [("KL to reference", [1, 2], [0.01, 0.01])])
    moved = [{**record, "approx_kl": 0.002} for record in steps]
    assert second_panel(moved)[1] == [("approx KL (policy update)", [1, 2], [0.002, 0.002])]
    ahead = [{**record, "staleness/mean": float(s)} for s, record in enumerate(with_kl)]
    assert second_panel(ahead)[2] == (
        "staleness (versions)",
        [("sample staleness, mean", [1, 2], [0.0, 1.0])],
    )
    assert second_panel([{"step": 1, "reward/mean": 0.2}]) == ("KL", [], None)
    measured = [{**record, "mismatch/kl": 1e-5 * s} for s, record in enumerate(steps)]
    assert second_panel(measured)[2] == (
        "engine mismatch",
        [("k3 KL(engine || learner)", [1, 2], [0.0, 1e-5])],
    )


def test_the_console_line_shows_the_mismatch_where_measured() -> None:
    line = format_console_line(3, {"reward/mean": 0.5, "mismatch/kl": 6.2e-5})
    assert line == "step 3  reward 0.500  mismatch 6.20e-05"


def test_summary_has_the_first_and_last_validation(tmp_path: Path) -> None:
    with make_logger(tmp_path)[0] as logger:
        logger.log(0, {"val/reward_mean": 0.1, "val/pass@1": 0.0})
        logger.log(1, {"reward/mean": 0.2})
        logger.log(2, {"reward/mean": 0.3, "val/reward_mean": 0.4, "val/pass@1": 0.5})
    result = summary(tmp_path / METRICS_FILE)
    assert (result["first_val_reward_mean"], result["last_val_reward_mean"]) == (0.1, 0.4)
    assert (result["first_val_pass1"], result["last_val_pass1"]) == (0.0, 0.5)
    assert result["val_steps"] == (0, 2)


def test_the_summary_names_the_best_checkpoint() -> None:
    from rlx.runs import RunResult
    from rlx.trainer.report.record import summary_lines

    result = RunResult("SUCCEEDED", "run", "runs/run", 10, last_step=10, checkpoints="ckpt/run")
    assert not any(line.startswith("best checkpoint") for line in summary_lines(result))
    result.best = {
        "metric": "val/avg@4",
        "mode": "max",
        "step": 6,
        "value": 0.4125,
        "checkpoint": "ckpt/run/step-000006",
    }
    assert "best checkpoint: val/avg@4 0.4125 at step 6 (max), ckpt/run/step-000006" in (
        summary_lines(result)
    )


def test_the_plot_shows_the_largest_sampled_pass_at_k_and_maj_beside_greedy_pass1(
    tmp_path: Path,
) -> None:
    from rlx.trainer.report.plots import validation_series

    records = [
        {"step": 0, "val/reward_mean": 0.1, "val/pass@1": 0.0, "val/pass@1_sampled": 0.1},
        {"step": 4, "val/pass@2": 0.2, "val/pass@4": 0.3, "val/avg@4": 0.1, "val/maj@4": 0.2},
    ]
    with make_logger(tmp_path)[0] as logger:
        for record in records:
            logger.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    png = write_plot(tmp_path / METRICS_FILE, tmp_path / "metrics.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    keys = [key for key, _ in validation_series(records)]
    assert keys == ["val/reward_mean", "val/pass@1", "val/pass@4", "val/maj@4"]
    labels = dict(validation_series(records))
    assert labels["val/pass@4"] == "validation pass@4"
    assert [key for key, _ in validation_series([{"step": 0, "loss": 1.0}])] == [
        "val/reward_mean",
        "val/pass@1",
    ]
