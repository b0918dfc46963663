"""`rlx status` and `rlx down --all` on a real local job: while it runs it is up, with hours
and a spend priced from a price file (this test's own figure for a CPU machine), and its own
status shows its progress; `rlx down --all` ends it (SIGINT, as a person's Ctrl-C), and then
it is no longer up, it is CANCELLED and its hours stop at its end."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.support.cli import launched_and_training, run_rlx

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)

# $3600 an hour: a dollar a second, so that seconds of running show as a spend
PRICES = """\
InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region
c.test,,,8,32,3600.00,,us-east-1
"""
MONEY = re.compile(r"\$[0-9,]+\.[0-9]{2}")


def row(output: str, name: str) -> str:
    (line,) = [line for line in output.splitlines() if f" {name} " in line]
    return line


def test_status_bills_a_running_local_job_and_down_all_ends_it(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    data["trainer"].update(steps=500)
    data["trainer"].pop("validation")  # the least CPU until the first step
    recipe = tmp_path / "bill.yaml"
    recipe.write_text(yaml.safe_dump(data))
    prices = tmp_path / "prices.csv"
    prices.write_text(PRICES)
    env = {"SKY_RUNTIME_DIR": str(tmp_path / "no-sky"), "COLUMNS": "250"}
    launched = time.time()
    args = ["--prices", str(prices)]  # the job carries its price: its result, its cost
    with launched_and_training(recipe, tmp_path, "billed", args=args, **env) as launch:
        up = run_rlx(["status", "--prices", str(prices)], tmp_path, timeout=120, **env)
        assert up.returncode == 0, up.stderr
        line = row(up.stdout, "billed")
        assert "RUNNING" in line and " yes " in line, up.stdout
        rate, spend = MONEY.findall(line)
        assert rate == "$3,600.00" and float(spend[1:].replace(",", "")) > 0, line
        own = run_rlx(["status", "billed"], tmp_path, timeout=120, **env)
        assert "RUNNING" in own.stdout and "step " in own.stdout, own.stdout

        down = run_rlx(["down", "--all"], tmp_path, timeout=180, **env)
        assert down.returncode == 0, down.stderr
        assert "stopped billed" in down.stderr.splitlines(), down.stderr
        _, err = launch.communicate(timeout=60)
        assert launch.returncode == 128 + 2, err[-3000:]  # SIGINT: a person stopped it

        after = run_rlx(["status"], tmp_path, timeout=120, **env)
        line = row(after.stdout, "billed")
        assert "CANCELLED" in line and " no " in line and "$" not in line, after.stdout
        assert "rlx status --prices FILE" in after.stdout  # no prices: said once, no figure
        assert re.search(r" [0-9]+\.[0-9]{2} ", line), line  # hours up to its end
    (result,) = tmp_path.glob("runs/billed-*/result.json")
    record = json.loads(result.read_text())
    cost = record["cost"]
    assert cost["per_hour"] == 3600.0 and cost["since"] == "launch", cost
    # a dollar a second from the launch, which came after `launched` and before the run's
    # start, to the run's end
    since_launched, since_started = (
        record["finished"] - launched,
        record["finished"] - record["started"],
    )
    assert since_started - 0.01 <= cost["dollars"] <= since_launched + 0.01, (cost, record)
