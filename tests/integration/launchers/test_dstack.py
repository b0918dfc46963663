"""dstack, for real: a `dstack server` on loopback with no backends, hence no offers.

Runs are submitted through `rlx launch --backend dstack` (with the fleet the job brings when
its recipe names none), found on the server through its API, fail there for want of a fleet
or an offer, and rlx says so in one line; `rlx status/logs/down` operate them. Needs the
`dstack_server` fixture: run with `-p tests.support.dstack_server`.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers import operations
from rlx.launchers.base import Job, recall, remember
from rlx.launchers.dstack.ops import NodeJob, RunView, verdict
from tests.conftest import RECIPES
from tests.support.cli import assert_one_line_error
from tests.support.dstack_server import DstackServer, free_port

GSM8K = RECIPES / "gsm8k-grpo.yaml"
# A `$` in a value: dstack interpolates env values on the server, so rlx must escape it.
SECRETS = {"HF_TOKEN": "hf_dstackTest$Value71", "WANDB_API_KEY": "wandb_dstackTestValue38"}
runner = CliRunner()


def two_node_recipe(write_recipe, name: str, *, fleets: bool = True, retry: bool = False) -> Path:
    """gsm8k-grpo on its 2 nodes, its state in a bucket, as shipped."""
    text = GSM8K.read_text()
    text = text[: text.index("\nslurm:")] + "\n"  # dstack's section last: retry goes there
    assert "volumes:" not in text and "dstack:\n  fleets: [l4-cluster]" in text
    if not fleets:
        text = text.replace("dstack:\n  fleets: [l4-cluster]", "dstack:\n  fleets: []")
    if retry:
        text += "  retry:\n    on_events: [no-capacity]\n    duration: 1h\n"
    return write_recipe(text, f"{name}.yaml")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dstack_client_env: DstackServer):
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return folder


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def listed(server: DstackServer) -> list[str]:
    """Names of the runs the server lists for the project (finished ones too)."""
    return [run.name for run in server.client().runs.list(all=True)]


def server_run(server: DstackServer, name: str):
    """The run model as the server has it, or None."""
    from dstack._internal.core.errors import ResourceNotExistsError

    try:
        return server.client().client.runs.get(server.project, name)
    except ResourceNotExistsError:
        return None


def wait_finished(server: DstackServer, name: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        run = server_run(server, name)
        assert run is not None, f"run {name} is not on the server"
        if run.status.is_finished():
            return run
        assert time.monotonic() < deadline, f"run {name} still {run.status} after {timeout}s"
        time.sleep(1.0)


# ------------------------------------------------------------------------- launch


@pytest.mark.timeout(300)
def test_gsm8k_is_refused_for_its_missing_volume(
    project: Path, dstack_server: DstackServer, write_recipe
):
    # One node with a network volume (one disk, one node: what dstack's volumes are for).
    text = GSM8K.read_text().replace("  nodes: 2\n", "  nodes: 1\n")
    text = text.replace("sky:\n  infra: gcp\n", "")  # SkyPilot has no volumes on GCP
    text = text.replace("\nsetup:", "\nvolumes:\n  - name: rlx-gsm8k\n    path: /data\n\nsetup:")
    recipe = write_recipe(text, "gsm8k-grpo.yaml")
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "gsm8k-vol")
    assert result.exit_code == 1
    assert_one_line_error(
        result.output, "dstack: volume rlx-gsm8k does not exist in project main", "dstack apply"
    )
    assert "gsm8k-vol" not in listed(dstack_server)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fleets,expected,hint",
    [
        # rlx applies the job's own fleet (nodes 0..2), in which no backend offers anything
        (False, "dstack: no offer can run this 2-node job in its fleet nofleet", "dstack offer"),
        (
            True,
            "dstack: fleet l4-cluster (under dstack.fleets) cannot run this 2-node job",
            "placement: cluster",
        ),
    ],
    ids=["no-fleet-named", "named-fleet"],
)
def test_distributed_run_without_a_fleet_is_reported(
    project: Path, dstack_server: DstackServer, write_recipe, fleets: bool, expected: str, hint: str
):
    name = "nofleet-named" if fleets else "nofleet"
    recipe = two_node_recipe(write_recipe, name, fleets=fleets)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", name)
    assert result.exit_code == 1
    line = assert_one_line_error(result.output, expected, hint)
    if not fleets:  # the job's own fleet is on the server, empty, its instances made on demand
        fleet = dstack_server.client().client.fleets.get(dstack_server.project, name)
        assert (fleet.spec.configuration.nodes.min, fleet.spec.configuration.nodes.max) == (0, 2)
        assert fleet.spec.configuration.idle_duration == 60
    # the run was really submitted: the server lists it, as 2 jobs, and fails it
    assert name in listed(dstack_server)
    run = wait_finished(dstack_server, name)
    assert run.status.value == "failed"
    assert sorted(job.job_spec.job_num for job in run.jobs) == [0, 1]
    # remembered anyway, and `rlx status` tells the same story
    status = invoke("status", name)
    assert status.exit_code == 0 and "FAILED" in status.output, status.output
    known = operations("dstack").status(recall(name, project))
    assert (known.state, known.detail) == ("FAILED", line.removeprefix("error: "))
    # logs: none, since no node ever started; each node is addressable, others are not
    for node in ("0", "1"):
        result = invoke("logs", name, "--node", node)
        assert result.exit_code == 0, result.output
        assert f"no logs from node {node}" in result.output
    result = invoke("logs", name, "--node", "2")
    assert result.exit_code == 1
    assert_one_line_error(result.output, f"node 2 is not in run {name} (nodes 0..1)")
    result = invoke("logs", name, "--follow")  # a finished run: returns at once, with
    assert result.exit_code == 1  # the run's outcome


@pytest.mark.timeout(300)
def test_down_stops_a_run_that_waits_for_capacity(
    project: Path, dstack_server: DstackServer, write_recipe
):
    recipe = two_node_recipe(write_recipe, "waiting", fleets=False, retry=True)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "waiting")
    assert result.exit_code == 0, result.output
    assert "launched waiting on dstack" in result.output
    run = server_run(dstack_server, "waiting")
    assert run is not None and not run.status.is_finished()
    status = invoke("status", "waiting")
    assert "PENDING" in status.output, status.output

    result = invoke("down", "waiting")
    assert result.exit_code == 0, result.output
    run = wait_finished(dstack_server, "waiting")
    assert run.termination_reason == "stopped_by_user"
    assert "CANCELLED" in invoke("status", "waiting").output
    # a second launch under the same name is fine once the first is over
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "waiting")
    assert result.exit_code == 0, result.output
    # ... but not while it is active
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "waiting")
    assert result.exit_code == 1
    assert_one_line_error(result.output, "run waiting is still active", "rlx down waiting")
    assert invoke("down", "waiting").exit_code == 0


@pytest.mark.timeout(300)
def test_a_run_the_server_does_not_know(project: Path):
    remember(Job("ghost", "dstack", "ghost", str(GSM8K), "", extra={"project": "main"}), project)
    status = operations("dstack").status(recall("ghost", project))
    assert (status.state, status.detail) == (
        "UNKNOWN",
        "no run ghost on the server (see `dstack ps -a`)",
    )
    for command in (["down", "ghost"], ["logs", "ghost"]):
        result = invoke(*command)
        assert result.exit_code == 1
        assert_one_line_error(result.output, "dstack:", "ghost")


# ------------------------------------------------------------------------- secrets


def db_places(db_path: Path, value: str) -> set[str]:
    """table.column of every text cell of the server's database that holds `value`."""
    places = set()
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for column in [c[1] for c in db.execute(f'PRAGMA table_info("{table}")')]:
                query = f'SELECT 1 FROM "{table}" WHERE instr(CAST("{column}" AS TEXT), ?) LIMIT 1'
                if db.execute(query, (value,)).fetchone():
                    places.add(f"{table}.{column}")
    return places


@pytest.mark.timeout(300)
def test_where_secret_values_go(project: Path, dstack_server: DstackServer, write_recipe):
    """dstack takes env values as part of the run spec and keeps them in its database (runs
    and jobs): that is where they must be, and nowhere else; rlx writes them nowhere."""
    recipe = two_node_recipe(write_recipe, "secrets", fleets=False, retry=True)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "secrets")
    assert result.exit_code == 0, result.output
    try:
        env = server_run(dstack_server, "secrets").run_spec.configuration.env
        for name, value in SECRETS.items():
            assert env[name] == value.replace("$", "$$")  # arrives as written on the node
            assert value not in result.output
        root = dstack_server.server_dir.parent  # server folder, client HOME, server log
        # as given, and as sent (with `$` doubled)
        forms = {f for v in SECRETS.values() for f in (v, v.replace("$", "$$"))}
        for form in forms:
            files = {
                p.relative_to(root).as_posix()
                for p in root.rglob("*")
                if p.is_file() and form.encode() in p.read_bytes()
            }
            assert files <= {"server/data/sqlite.db", "server/data/sqlite.db-wal"}, files
            places = db_places(dstack_server.server_dir / "data" / "sqlite.db", form)
            assert places <= {"runs.run_spec", "jobs.job_spec_data"}, places
            assert not [p for p in project.rglob("*") if p.is_file() and form in p.read_text()]
        sent = [v.replace("$", "$$") for v in SECRETS.values()]
        assert all(
            "runs.run_spec" in db_places(dstack_server.server_dir / "data" / "sqlite.db", v)
            for v in sent
        )
    finally:
        invoke("down", "secrets")


# ------------------------------------------------------------------------- client configuration


@pytest.mark.timeout(300)
def test_client_configured_by_environment(
    project: Path, dstack_server: DstackServer, write_recipe, monkeypatch, tmp_path: Path
):
    empty_home = tmp_path / "empty-home"
    empty_home.mkdir()
    monkeypatch.setenv("HOME", str(empty_home))
    recipe = two_node_recipe(write_recipe, "envcfg", fleets=False, retry=True)

    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "envcfg")
    assert result.exit_code == 1
    assert_one_line_error(result.output, "no project is configured", "dstack project add")

    monkeypatch.setenv("DSTACK_SERVER_URL", dstack_server.url)
    monkeypatch.setenv("DSTACK_TOKEN", "not-the-token")
    monkeypatch.setenv("DSTACK_PROJECT", dstack_server.project)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "envcfg")
    assert result.exit_code == 1
    assert_one_line_error(result.output, "refused the token for project main")

    monkeypatch.setenv("DSTACK_TOKEN", dstack_server.token)
    monkeypatch.setenv("DSTACK_PROJECT", "nope")
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "envcfg")
    assert result.exit_code == 1
    assert_one_line_error(result.output, "project nope does not exist")

    monkeypatch.setenv("DSTACK_PROJECT", dstack_server.project)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "envcfg")
    assert result.exit_code == 0, result.output
    assert "envcfg" in listed(dstack_server)
    assert invoke("down", "envcfg").exit_code == 0


@pytest.mark.timeout(300)
def test_unreachable_server(project: Path, monkeypatch, write_recipe):
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("DSTACK_SERVER_URL", url)
    monkeypatch.setenv("DSTACK_TOKEN", "x")
    monkeypatch.setenv("DSTACK_PROJECT", "main")
    recipe = two_node_recipe(write_recipe, "unreachable", fleets=False)
    result = invoke("launch", str(recipe), "--backend", "dstack", "--name", "unreachable")
    assert result.exit_code == 1
    assert_one_line_error(result.output, f"cannot reach the server at {url}", "dstack server")


# ------------------------------------------------------------------------- pure verdicts


def node(n: int, status: str, reason: str = "", message: str = "", code=None) -> NodeJob:
    return NodeJob(n, status, reason, message, code)


NO_ROOM = "failed_to_start_due_to_no_capacity"


def test_verdicts():
    def run(status, reason="", jobs=(), retry=False, fleets=()):
        return RunView("r", status, reason, 2, fleets, tuple(jobs), retry)

    waiting = run("submitted", jobs=[node(0, "failed", NO_ROOM, "No matching fleet")], retry=True)
    assert verdict(waiting).state == "PENDING"
    assert "waiting to retry: No matching fleet" in verdict(waiting).detail
    assert verdict(run("failed", "job_failed", [node(0, "failed", NO_ROOM)])).state == "FAILED"
    stopped = run("terminated", "stopped_by_user", [node(0, "failed", NO_ROOM)])
    assert verdict(stopped).state == "CANCELLED"
    crashed = run(
        "failed",
        "job_failed",
        [
            node(0, "terminated", "terminated_by_server"),
            node(1, "failed", "container_exited_with_error", "exit 3"),
        ],
    )
    assert verdict(crashed).state == "FAILED"
    assert "node 1 container_exited_with_error: exit 3" in verdict(crashed).detail
    done = verdict(run("done", "all_jobs_done", [node(0, "done", code=0), node(1, "done")]))
    assert (done.state, done.exit_code) == ("SUCCEEDED", 0)
    assert verdict(run("running", jobs=[node(0, "running"), node(1, "running")])).state == "RUNNING"


def test_secret_values_survive_dstack_interpolation():
    """Values reach the node as given: dstack's server interpolates `${{ }}` in env values
    and reads `$$` as `$`, so rlx sends them escaped."""
    pytest.importorskip("dstack")
    from dstack._internal.utils.interpolator import VariablesInterpolator

    from rlx.launchers.dstack.render import escape

    interpolate = VariablesInterpolator({"secrets": {"x": "LEAK"}}).interpolate_or_error
    for value in ("plain", "a$b", "$$", "${{ secrets.x }}", "end$"):
        assert interpolate(escape(value)) == value
