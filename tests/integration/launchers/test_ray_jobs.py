"""`rlx launch -b ray`: the submission request and the errors a user meets before any
cluster answers (the whole path against a real cluster is in tests/hosts/test_rayjobs.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers import render
from rlx.launchers.ray.ops import STOPPED_EXIT, exit_code
from rlx.recipe import parse_recipe
from tests.support.cli import run_rlx

runner = CliRunner()


def recipe_text(**extra: object) -> str:
    return yaml.safe_dump({"name": "sub", "command": ["echo one", "exit 3"], **extra})


def test_the_request_is_what_ray_accepts() -> None:
    ray = pytest.importorskip("ray")
    recipe = parse_recipe(recipe_text(env={"A": "b c"}, secrets=["HF_TOKEN"]), "r.yaml").recipe
    request = json.loads(render("ray", recipe, "r.yaml"))
    # The entrypoint is one shell line that bash runs as the head would.
    argv = shlex.split(request["entrypoint"])
    assert argv[:2] == ["bash", "-c"] and argv[2] == "set -e\necho one\nexit 3\n"
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout) == (3, "one\n")
    env = request["runtime_env"]["env_vars"]
    assert env["A"] == "b c" and "RLX_RECIPE_JSON" in env
    assert env["HF_TOKEN"].startswith("<")  # a name, never a value
    ray.runtime_env.RuntimeEnv(**request["runtime_env"])


def test_no_address_no_token_and_wrong_flags_are_one_line(tmp_path: Path, write_recipe) -> None:
    path = write_recipe(recipe_text())
    result = runner.invoke(app, ["launch", str(path), "-b", "ray"], env={"RAY_ADDRESS": ""})
    assert result.exit_code == 1 and "--address http://HOST:8265" in result.output
    result = runner.invoke(app, ["launch", str(path), "-b", "ray", "--address", "ray://h:10001"])
    assert result.exit_code == 1 and "dashboard's URL" in result.output
    result = runner.invoke(
        app,
        ["launch", str(path), "-b", "ray", "--address", "http://127.0.0.1:9"],
        env={"RAY_AUTH_TOKEN": "", "RLX_RAY_TOKEN": ""},
    )
    assert result.exit_code == 1 and "no Ray token" in result.output
    result = runner.invoke(app, ["launch", str(path), "-b", "sky", "--address", "http://x:1"])
    assert result.exit_code == 1 and "use it with --backend ray" in result.output
    result = runner.invoke(app, ["launch", str(path), "--keep"])
    assert result.exit_code == 1
    assert "--keep is for a cluster kept up with no trainer on SkyPilot, dstack or Slurm" in (
        result.output
    )
    result = runner.invoke(app, ["launch", str(path), "-b", "dstack", "--managed"])
    assert result.exit_code == 1 and "--managed is for managed jobs" in result.output
    assert "use it with --backend sky" in result.output


def test_unreachable_dashboard_names_the_tunnel(tmp_path: Path, write_recipe) -> None:
    pytest.importorskip("ray")
    path = write_recipe(recipe_text())
    done = run_rlx(
        ["launch", str(path), "-b", "ray", "--address", "http://127.0.0.1:9"],
        tmp_path,
        timeout=120,
        RAY_AUTH_TOKEN="t",
    )
    assert done.returncode == 1, done.stderr
    assert "cannot reach the dashboard at http://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_working_dir_over_rays_limit_is_named(tmp_path: Path, write_recipe) -> None:
    pytest.importorskip("ray")
    work = tmp_path / "code"
    work.mkdir()
    (work / "main.py").write_text("print('hi')\n")
    (work / "data.bin").write_bytes(os.urandom(3 * 2**20))
    path = write_recipe(recipe_text(workdir=str(work)))
    args = ["launch", str(path), "-b", "ray", "--address", "http://127.0.0.1:9"]
    # Ray's limit follows its gRPC message size; 2 MiB here stands for the 500 MiB default.
    small = {"RAY_AUTH_TOKEN": "t", "RAY_max_grpc_message_size": str(2 * 2**20)}
    done = run_rlx(args, tmp_path, timeout=120, **small)
    assert done.returncode == 1
    assert "holds 3 MiB after Ray's excludes; Ray uploads at most 2 MiB" in done.stderr
    # Ray's own excludes count: with the data in .rayignore the upload is small enough.
    (work / ".rayignore").write_text("data.bin\n")
    done = run_rlx(args, tmp_path, timeout=120, **small)
    assert "cannot reach the dashboard" in done.stderr, done.stderr


def test_exit_code_is_the_jobs_own_outcome() -> None:
    pytest.importorskip("ray")
    from ray.job_submission import JobDetails, JobStatus

    def details(status: JobStatus, code: int | None) -> JobDetails:
        return JobDetails(type="SUBMISSION", entrypoint="x", status=status, driver_exit_code=code)

    assert exit_code(details(JobStatus.RUNNING, None)) is None
    assert exit_code(details(JobStatus.SUCCEEDED, 0)) == 0
    # A non-zero driver exit is never 0, whatever state Ray gives the job.
    assert exit_code(details(JobStatus.SUCCEEDED, 3)) == 3
    assert exit_code(details(JobStatus.FAILED, 3)) == 3
    assert exit_code(details(JobStatus.FAILED, None)) == 1
    assert exit_code(details(JobStatus.STOPPED, None)) == STOPPED_EXIT
