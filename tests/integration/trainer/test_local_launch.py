"""`rlx launch` with the local backend (the default): a short quickstart trains to the end
in the foreground, prints the summary and leaves metrics, plot and checkpoints; `rlx
status`, `rlx logs` and `rlx down` then operate on it. (A running local job's status and its
`rlx down`: test_local_bill.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.support.cli import run_rlx

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)


def quickstart_variant(folder: Path, **trainer: object) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    data["trainer"].update(trainer)
    path = folder / "quick.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_launch_trains_and_the_job_can_be_inspected(tmp_path: Path) -> None:
    recipe = quickstart_variant(
        tmp_path, steps=6, checkpoint={"dir": "runs/checkpoints", "every": 3, "keep": 2}
    )
    dry = run_rlx(["launch", str(recipe), "--dry-run"], tmp_path, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "local backend" in dry.stdout and "tiny:qwen2-h64-l2" in dry.stdout

    result = run_rlx(["launch", str(recipe)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "succeeded" in result.stdout and "mean of the first and last" in result.stdout
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("quickstart-")]
    assert len(runs) == 1
    run_dir = runs[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 0: the quickstart's validation before training; then one record per step
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert "val/pass@1" in records[0] and "val/pass@1" in records[-1]
    assert (run_dir / "reward.png").stat().st_size > 10_000
    checkpoints = tmp_path / "runs" / "checkpoints" / run_dir.name
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000006"]
    assert "step 6" in (run_dir / "train.log").read_text()

    status = run_rlx(["status"], tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "quickstart" in status.stdout and "SUCCEEDED" in status.stdout
    logs = run_rlx(["logs", "quickstart"], tmp_path, timeout=120)
    assert logs.returncode == 0 and "step 6" in logs.stdout
    down = run_rlx(["down", "quickstart"], tmp_path, timeout=120)
    assert down.returncode == 1 and "not running" in down.stderr
