"""`rlx status`'s bill: hours up from the launch to now (or to the recorded end), the hourly
price of what the job's recipe asks for from a price file (this test's own figures), the spend;
a dash and one line without prices, never a figure of rlx's own. `rlx down --all` ends every
job still up, one line each, exit 1 naming those that did not stop."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from rlx import launchers
from rlx.cli import app
from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, recall, remember
from rlx.launchers.bill import Bill, Rate, hourly_rate, hours_up, job_bill
from rlx.node.env import recipe_json
from rlx.plan.prices import load_prices, no_prices
from rlx.recipe.load import parse_recipe
from tests.support.cli import assert_one_line_error

runner = CliRunner()
HOUR = 3600.0
PRICES = """\
InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region
big.gpu,H100,8,192,2048,100.00,40.00,us-east-1
mid.gpu,A100-80GB,8,96,1152,60.00,,us-east-1
small.cpu,,,4,16,0.25,0.10,us-east-1
tiny.cpu,,,2,4,0.10,0.05,us-east-1
"""


@pytest.fixture(autouse=True)
def no_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyPilot's catalog cache lives under SKY_RUNTIME_DIR: empty here."""
    home = tmp_path / "sky-home"
    home.mkdir()
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(home))


@pytest.fixture
def price_file(tmp_path: Path) -> Path:
    path = tmp_path / "prices.csv"
    path.write_text(PRICES)
    return path


def recipe(resources: str):
    return parse_recipe(f"name: job\nresources: {resources}\ncommand: [echo]\n").recipe


def test_hours_run_from_the_launch_to_now_while_up_else_to_the_recorded_end():
    assert hours_up(0.0, True, None, 1.5 * HOUR) == 1.5
    assert hours_up(0.0, True, 0.5 * HOUR, 2 * HOUR) == 2.0  # up still: now counts
    assert hours_up(0.0, False, 0.5 * HOUR, 2 * HOUR) == 0.5
    assert hours_up(0.0, False, None, 2 * HOUR) is None  # ended, but when is not known
    assert hours_up(0.0, None, None, 2 * HOUR) is None  # could not tell whether it is up


def test_the_rate_is_the_first_alternative_with_the_recipes_spot_setting(price_file: Path):
    prices = load_prices(price_file)
    on_demand = recipe("{nodes: 2, accelerators: [H100:8, A100-80GB:8]}")
    assert hourly_rate(on_demand, prices) == Rate(200.0, "H100:8")
    spot = recipe("{nodes: 2, accelerators: 'H100:8', spot: true}")
    assert hourly_rate(spot, prices) == Rate(80.0, "")
    # spot: auto: whichever the backend got, at most the on-demand price
    auto = recipe("{nodes: 2, accelerators: 'H100:8', spot: auto}")
    assert hourly_rate(auto, prices) == Rate(200.0, "", at_most=True)
    # no spot price for the A100 machine: no rate, not a guess
    assert hourly_rate(recipe("{accelerators: 'A100-80GB:8', spot: true}"), prices) is None
    # CPU nodes: the cheapest CPU machine with the recipe's cpus and memory
    assert hourly_rate(recipe("{nodes: 3, cpus: '4+'}"), prices) == Rate(0.75, "")
    assert hourly_rate(recipe("{accelerators: 'L4:1'}"), prices) is None  # no row for it


def test_a_priced_launch_gives_the_run_its_cost(price_file: Path):
    from rlx.launchers.bill import priced_recipe
    from rlx.runs import cost_line, run_cost

    auto = recipe("{nodes: 2, accelerators: [H100:8, A100-80GB:8], spot: auto}")
    priced = priced_recipe(auto, hourly_rate(auto, load_prices(price_file)), 1000.0)
    cost = run_cost(priced.env, started=1900.0, ended=1000.0 + 1.5 * HOUR)
    assert cost == {
        "per_hour": 200.0,
        "hours": 1.5,
        "dollars": 300.0,
        "at_most": True,
        "label": "H100:8",
        "since": "launch",
    }
    assert cost_line(cost) == "cost: <= $300.00 (1.50 h since launch at <= $200.00/h, H100:8)"
    # without the launch's time: from the run's own start; without a price: none at all
    alone = {"RLX_PRICE_PER_HOUR": "0.5"}
    assert run_cost(alone, started=0.0, ended=HOUR)["since"] == "start"
    assert run_cost({}, started=0.0, ended=HOUR) is None
    assert run_cost({"RLX_PRICE_PER_HOUR": "n/a"}, started=0.0, ended=HOUR) is None


def test_cells_say_a_dash_for_what_is_not_known():
    priced = Bill(True, 2.0, Rate(200.0, "H100:8"))
    assert priced.spend == 400.0
    assert priced.cells() == ("yes", "2.00", "$200.00 (H100:8)", "$400.00")
    assert Bill(False, None, Rate(1.0, "")).cells() == ("no", "-", "$1.00", "-")
    assert Bill(None, None, None).cells() == ("?", "-", "-", "-")
    assert Bill(True, 1.0, Rate(3.0, "", at_most=True)).cells()[2:] == ("<= $3.00", "<= $3.00")


def test_a_jobs_bill_from_its_record_and_status(price_file: Path):
    prices = load_prices(price_file)
    job = Job("job", "sky", "job", "job.yaml", "", launched_at=1000.0)
    job.recipe = recipe_json(recipe("{nodes: 2, accelerators: 'H100:8'}"))
    up = JobStatus("job", "sky", "SUCCEEDED", up=True)  # done, the cluster not yet down
    bill = job_bill(job, up, prices, 1000.0 + 0.5 * HOUR)
    assert (bill.up, bill.hours, bill.spend) == (True, 0.5, 100.0)
    ended = JobStatus("job", "sky", "SUCCEEDED", up=False, ended_at=1000.0 + HOUR)
    assert job_bill(job, ended, prices, 1e9).spend == 200.0
    job.ended_at = 1000.0 + 2 * HOUR  # `rlx down` recorded it
    assert job_bill(job, JobStatus("job", "sky", "UNKNOWN", up=False), prices, 1e9).hours == 2.0
    assert job_bill(job, None, prices, 1e9).up is None
    # no price data, or an older record without the recipe: hours only
    assert job_bill(job, ended, None, 1e9).rate is None
    job.recipe = ""
    assert job_bill(job, ended, prices, 1e9).cells()[2:] == ("-", "-")


def test_up_follows_the_state_unless_the_backend_knows_better():
    assert JobStatus("j", "x", "RUNNING").is_up and JobStatus("j", "x", "PENDING").is_up
    assert not JobStatus("j", "x", "SUCCEEDED").is_up
    assert JobStatus("j", "x", "SUCCEEDED", up=True).is_up
    assert not JobStatus("j", "x", "PENDING", up=False).is_up


# --------------------------------------------------------------------------- the commands


@dataclass
class FakeBackend:
    """A backend's operations as the CLI calls them, with states set by the test."""

    states: dict[str, str]
    unstoppable: set[str] = field(default_factory=set)
    unreadable: set[str] = field(default_factory=set)
    downed: list[str] = field(default_factory=list)

    def status(self, job: Job) -> JobStatus:
        if job.name in self.unreadable:
            raise RlxError(f"cannot reach the server of {job.name}")
        return JobStatus(job.name, job.backend, self.states[job.name], "detail")

    def down(self, job: Job) -> None:
        if job.name in self.unstoppable:
            raise RlxError(f"{job.name} would not stop")
        self.downed.append(job.name)
        self.states[job.name] = "CANCELLED"


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def launched(folder: Path, backend: FakeBackend, monkeypatch, **states: str) -> None:
    job_recipe = recipe("{nodes: 2, accelerators: 'H100:8'}")
    for n, (name, state) in enumerate(states.items()):
        job = Job(name, "dstack", name, "job.yaml", "", launched_at=1000.0 + n)
        job.recipe = recipe_json(job_recipe)
        remember(job, folder)
        backend.states[name] = state
    monkeypatch.setattr(launchers, "operations", lambda name: backend)
    monkeypatch.setattr("time.time", lambda: 1000.0 + 3 * HOUR)
    monkeypatch.setenv("COLUMNS", "250")  # a row on one line


def test_status_shows_up_hours_rate_and_spend(folder, price_file, monkeypatch):
    backend = FakeBackend({})
    launched(folder, backend, monkeypatch, train="RUNNING", old="SUCCEEDED")
    result = runner.invoke(app, ["status", "--prices", str(price_file)])
    assert result.exit_code == 0, result.output
    (train,) = [line for line in result.stdout.splitlines() if "train" in line]
    assert "yes" in train and "3.00" in train and "$200.00" in train and "$600.00" in train
    (old,) = [line for line in result.stdout.splitlines() if "old" in line]
    assert " no " in old and "$200.00" in old  # the rate, but no hours: when it ended is unknown
    assert "prices: none" not in result.stdout


def test_status_without_prices_a_dash_and_one_line(folder, monkeypatch):
    backend = FakeBackend({})
    launched(folder, backend, monkeypatch, train="RUNNING")
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "$" not in result.stdout.replace("$/hour", "")
    assert result.stdout.count(no_prices("rlx status")) == 1


def test_status_of_several_shows_a_backend_that_cannot_say_as_a_row(folder, monkeypatch):
    backend = FakeBackend({}, unreadable={"lost"})
    launched(folder, backend, monkeypatch, train="RUNNING", lost="RUNNING")
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "cannot reach the server of lost" in result.stdout
    # one job by name: its error is the answer
    assert_one_line_error(runner.invoke(app, ["status", "lost"]), "cannot reach the server")


def test_down_all_ends_every_job_still_up(folder, monkeypatch):
    backend = FakeBackend({})
    launched(folder, backend, monkeypatch, a="RUNNING", b="SUCCEEDED", c="PENDING")
    result = runner.invoke(app, ["down", "--all"])
    assert result.exit_code == 0, result.output
    assert backend.downed == ["a", "c"]
    assert result.output.splitlines() == ["stopped a", "stopped c"]
    assert recall("a", folder).ended_at == 1000.0 + 3 * HOUR  # what status counts hours to
    assert recall("b", folder).ended_at is None
    again = runner.invoke(app, ["down", "--all"])
    assert again.exit_code == 0 and "nothing up among the 3 job(s)" in again.output


def test_down_all_names_the_jobs_that_did_not_stop(folder, monkeypatch):
    backend = FakeBackend({}, unstoppable={"stuck"}, unreadable={"lost"})
    launched(folder, backend, monkeypatch, stuck="RUNNING", lost="RUNNING", fine="RUNNING")
    result = runner.invoke(app, ["down", "--all"])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert "did not stop stuck: stuck would not stop" in lines
    assert any(line.startswith("did not stop lost: cannot tell whether it is up") for line in lines)
    assert "stopped fine" in lines
    assert_one_line_error(result, "2 job(s) did not stop: stuck, lost")


@pytest.mark.parametrize(
    "args,says",
    [([], "needs a job NAME, or --all"), (["x", "--all"], "a job NAME or --all, not both")],
)
def test_down_needs_a_name_or_all(folder, args: list[str], says: str):
    assert_one_line_error(runner.invoke(app, ["down", *args]), says)


def test_the_registry_keeps_the_launch_time_and_reads_older_records(folder: Path):
    job = Job("j", "local", "1", "r.yaml", "", launched_at=123.0)
    path = remember(job, folder)
    record = json.loads(path.read_text())
    assert record["launched_at"] == 123.0 and record["ended_at"] is None
    del record["ended_at"]  # a record from before ended_at
    path.write_text(json.dumps(record))
    assert recall("j", folder).ended_at is None


# --------------------------------------------------------------------------- each backend's "up"


def test_a_skypilot_cluster_is_up_until_it_is_torn_down(monkeypatch):
    from rlx.launchers.sky import ops as sky_ops

    answers: dict[str, object] = {}
    fake = SimpleNamespace(
        status=lambda names, all_users: "status",
        job_status=lambda name, ids: "job_status",
        get=lambda request: answers[request],
    )
    monkeypatch.setattr(sky_ops, "_sky", lambda: fake)
    job = Job("c", "sky", "c", "c.yaml", "")
    answers.update(status=[{"status": "UP"}], job_status={1: "SUCCEEDED"})
    done = sky_ops.status(job)
    assert done.state == "SUCCEEDED" and done.is_up  # autostop has not taken it down yet
    answers.update(status=[{"status": "STOPPED"}])
    assert not sky_ops.status(job).is_up
    answers.update(status=[])
    assert not sky_ops.status(job).is_up


@pytest.mark.parametrize(
    "state,up", [("PENDING", False), ("CONFIGURING", True), ("RUNNING", True), ("COMPLETED", False)]
)
def test_a_slurm_job_is_up_while_it_holds_its_nodes(monkeypatch, state: str, up: bool):
    from rlx.launchers.slurm import ops as slurm_ops

    monkeypatch.setattr(slurm_ops, "job_state", lambda job: (state, None, ""))
    monkeypatch.setattr(slurm_ops, "_progress", lambda job: "")
    assert slurm_ops.status(Job("s", "slurm", "7", "s.yaml", "")).is_up is up


def test_a_local_job_is_up_while_its_launching_process_is(monkeypatch, tmp_path: Path):
    from rlx.launchers.local import ops as local_ops

    job = Job("l", "local", "123", "l.yaml", "", extra={"exit_code": "0"}, ended_at=50.0)
    monkeypatch.setattr(local_ops, "_pid_running", lambda job: False)
    ended = local_ops.status(job)
    assert (ended.state, ended.is_up, ended.ended_at) == ("SUCCEEDED", False, 50.0)
    monkeypatch.setattr(local_ops, "_pid_running", lambda job: True)
    assert local_ops.status(job).is_up  # its summary still printing: still up
