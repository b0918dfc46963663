"""Hostile strings in a recipe reach the nodes byte for byte and execute nothing.

Each backend's rendered file is run the way that backend runs it: SkyPilot's run block with
the task's envs, dstack's commands with the env dstack's server produces (after its
`${{ }}` interpolation), and the Slurm script under bash with small stand-ins for scontrol
and srun. A stand-in `rlx` records the environment it is started with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlx.errors import RlxError
from rlx.launchers import render
from rlx.launchers.dstack.render import task_text
from rlx.recipe import parse_recipe
from rlx.recipe.model import Recipe

FAKE_RLX = """#!{python}
import json, os, sys
with open(os.environ["RLX_TEST_DUMP"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""
FAKE_SCONTROL = "#!/bin/bash\necho node1\n"
# srun: drop the options, run the command on "this node" once.
FAKE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
export SLURMD_NODENAME=node1
exec "$@"
"""


def nasty(marker: Path) -> str:
    return (
        f"$(touch {marker}) `touch {marker}` ; touch {marker} ; 'single' \"double\" "
        "back\\slash\nsecond line ${{ secrets.x }} $HOME $$ %s {} !!"
    )


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Recipe, str, Path]:
    marker = tmp_path / "pwned"
    value = nasty(marker)
    text = yaml.safe_dump(
        {
            "name": "inject",
            "env": {"NASTY": value},
            "ray": {"auth": "none"},
            "trainer": {"model": {"path": value}, "data": {"train": value}},
        }
    )
    return parse_recipe(text, "inject.yaml").recipe, value, marker


def make_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("rlx", FAKE_RLX.format(python=sys.executable)),
        ("scontrol", FAKE_SCONTROL),
        ("srun", FAKE_SRUN),
    ):
        path = bin_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return bin_dir


def run_block(script: str, env: dict[str, str], tmp_path: Path) -> dict:
    dump = tmp_path / "dump.json"
    full = {
        "PATH": f"{make_bin(tmp_path)}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "RLX_TEST_DUMP": str(dump),
        **env,
    }
    subprocess.run(["bash", "-c", script], env=full, cwd=tmp_path, check=True, timeout=60)
    return json.loads(dump.read_text())


def check(seen: dict, value: str, marker: Path, backend: str, env_value: str | None = None):
    env_value = value if env_value is None else env_value
    assert not marker.exists(), "a recipe value was executed"
    assert seen["argv"] == ["node", "--backend", backend]
    assert seen["env"]["NASTY"] == env_value
    carried = Recipe.model_validate_json(seen["env"]["RLX_RECIPE_JSON"])
    assert carried.trainer is not None
    assert carried.trainer.model.path == value
    assert carried.trainer.data.train == value
    assert carried.env["NASTY"] == env_value


def test_skypilot(hostile, tmp_path):
    sky = pytest.importorskip("sky")
    recipe, value, marker = hostile
    task = sky.Task.from_yaml_config(yaml.safe_load(render("sky", recipe, "inject.yaml")))
    check(run_block(task.run, dict(task.envs), tmp_path), value, marker, "sky")


def test_dstack(hostile, tmp_path):
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import parse_run_configuration
    from dstack._internal.utils.interpolator import VariablesInterpolator

    recipe, value, marker = hostile
    # dstack's env list holds one line per variable: a line break in a plain env value is
    # refused with a clear error (and by lint); inside the recipe JSON it is escaped.
    with pytest.raises(RlxError, match=r"env\.NASTY: dstack cannot pass a value with a line break"):
        render("dstack", recipe, "inject.yaml")
    single_line = value.replace("\n", " ")
    recipe = recipe.model_copy(update={"env": {"NASTY": single_line}})
    conf = parse_run_configuration(task_text(render("dstack", recipe, "inject.yaml")))
    # What dstack's server does to env values before the job starts.
    interpolate = VariablesInterpolator({"secrets": {}}).interpolate_or_error
    env = {k: interpolate(v) for k, v in conf.env.as_dict().items() if isinstance(v, str)}
    seen = run_block("\n".join(conf.commands), env, tmp_path)
    check(seen, value, marker, "dstack", env_value=single_line)


def test_slurm(hostile, tmp_path):
    recipe, value, marker = hostile
    script = tmp_path / "job.sbatch"
    script.write_text(render("slurm", recipe, "inject.yaml"))
    (tmp_path / "rlx-logs").mkdir()
    env = {"SLURM_JOB_NAME": "inject", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1"}
    check(run_block(f"bash {script}", env, tmp_path), value, marker, "slurm")
    driver = tmp_path / "rlx-logs" / "inject-42" / "driver.log"
    assert "head finished with exit code 0" in driver.read_text()


def test_source_path_cannot_break_out_of_the_header():
    recipe = parse_recipe("name: job\ncommand: [echo hi]\n").recipe
    for backend in ("sky", "dstack", "slurm"):
        text = render(backend, recipe, "evil\n#SBATCH --wrap=touch /tmp/x\n.yaml")
        assert "\n#SBATCH --wrap" not in text
        assert "\ntouch" not in text


def test_secret_values_never_rendered(monkeypatch):
    value = "s3cr3t-" + os.urandom(8).hex()
    for name in ("HF_TOKEN", "WANDB_API_KEY", "RLX_RAY_TOKEN"):
        monkeypatch.setenv(name, value)
    from rlx.recipe import load_recipe
    from tests.conftest import RECIPES

    for path in RECIPES.glob("*.yaml"):
        for backend in ("sky", "dstack", "slurm"):
            assert value not in render(backend, load_recipe(path).recipe, str(path))
