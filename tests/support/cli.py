"""Running rlx as a user does, in one place: in-process through Typer's runner (fast, for
what needs no process of its own), or as `python -m rlx` from this checkout in a process of
its own; and the check every error path shares: one red line, exit 1, no traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def rlx_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """An environment in which `python -m rlx` runs this checkout: `base` as it is when given,
    else the test's own without the Ray and rlx variables a test process may carry (a stray
    RAY_ADDRESS must not reach the run); `extra` laid over it."""
    if base is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLX_"))}
    else:
        env = dict(base)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_rlx(
    args: list[str],
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    **extra: str,
) -> subprocess.CompletedProcess[str]:
    """`python -m rlx ARGS` in cwd, in a session of its own: whatever it leaves behind (Ray's
    per-node agents outlive a killed driver) is killed with its process group after it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlx", *args],
        cwd=cwd,
        env=rlx_env(env, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextlib.contextmanager
def launched_and_training(
    recipe: Path,
    cwd: Path,
    name: str,
    timeout: float = 300,
    args: Sequence[str] = (),
    **extra: str,
) -> Iterator[subprocess.Popen[str]]:
    """`rlx launch RECIPE --name NAME [ARGS]` (the local backend) in the background, yielded
    once its run has logged a step (runs/NAME-*/metrics.jsonl under cwd); killed after, if it
    still runs. The launch ending before it logs a step fails the test with its output."""
    launch = subprocess.Popen(
        [sys.executable, "-m", "rlx", "launch", str(recipe), "--name", name, *args],
        cwd=cwd,
        env=rlx_env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        metrics: list[Path] = []
        while time.monotonic() < deadline and not metrics:
            metrics = [m for m in cwd.glob(f"runs/{name}-*/metrics.jsonl") if m.read_text().strip()]
            assert launch.poll() is None, launch.communicate()
            time.sleep(0.5)
        assert metrics, "the job never logged a step"
        yield launch
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()


def invoke(args: list[str], env: Mapping[str, str] | None = None) -> Any:
    """`rlx ARGS` in this process (Typer's CliRunner); only SystemExit may end it."""
    from typer.testing import CliRunner

    from rlx.cli import app

    result = CliRunner().invoke(app, list(args), env=dict(env or {}))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def assert_one_line_error(result: Any, *needles: str) -> str:
    """An error as rlx shows it: exit code 1, exactly one `error:` line holding every
    needle, no traceback. `result` is a run_rlx or invoke result, or the output text."""
    if isinstance(result, str):
        output = result
    elif hasattr(result, "returncode"):  # a process
        assert result.returncode == 1, result.stdout + result.stderr
        output = result.stderr
    else:  # Typer's runner
        assert result.exit_code == 1, result.output
        output = result.output
    assert "Traceback" not in output, output
    errors = error_lines(output)
    assert len(errors) == 1, output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]
