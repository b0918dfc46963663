"""Accelerator alternatives, spot auto, a price cap and places: what each backend's own parser
reads from the rendering, what `rlx launch --dry-run` lists, and what each backend refuses in
one line. The golden files of these recipes are checked in test_render.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers import render
from rlx.launchers.dstack.render import task_text
from rlx.lint import lint_file
from rlx.recipe import load_recipe
from tests.conftest import RECIPES, REPO

ALTERNATIVES = REPO / "tests" / "recipes" / "alternatives.yaml"
ALTERNATIVES_SET = REPO / "tests" / "recipes" / "alternatives-set.yaml"
runner = CliRunner()


def rendered(path: Path, backend: str, **resources: object) -> str:
    recipe = load_recipe(path).recipe
    if resources:
        recipe = recipe.model_copy(
            update={"resources": recipe.resources.model_copy(update=resources)}
        )
    return render(backend, recipe, str(path))


def test_skypilot_reads_the_ordered_candidates():
    sky = pytest.importorskip("sky")
    task = sky.Task.from_yaml_config(yaml.safe_load(rendered(ALTERNATIVES, "sky")))
    candidates = [
        (r.accelerators, r.use_spot, r.infra.to_str(), r.max_hourly_cost) for r in task.resources
    ]
    print("SkyPilot candidates, in order:", *candidates, sep="\n  ")
    assert isinstance(task.resources, list)  # an order SkyPilot keeps: the first it can get
    assert candidates == [
        ({gpu: 8}, spot, place, 30.0)
        for spot in (True, False)
        for gpu in ("H100", "A100-80GB")
        for place in ("aws/us-east-1", "gcp/us-central1")
    ]


def test_skypilot_reads_a_set():
    sky = pytest.importorskip("sky")
    task = sky.Task.from_yaml_config(yaml.safe_load(rendered(ALTERNATIVES_SET, "sky")))
    print("SkyPilot candidates, any of:", *task.resources, sep="\n  ")
    assert isinstance(task.resources, set)
    assert {(tuple(r.accelerators.items()), r.use_spot) for r in task.resources} == {
        ((("H100", 8),), True),
        ((("A100-80GB", 8),), True),
    }


def test_skypilot_job_group_takes_alternatives_per_group():
    pytest.importorskip("sky")
    from sky.utils import dag_utils

    recipe = load_recipe(RECIPES / "grpo-async.yaml").recipe
    groups = recipe.resources.groups
    if groups is None:
        pytest.skip("grpo-async has no groups")
    train = groups.train.model_copy(update={"accelerators": ["H100:8", "A100-80GB:8"]})
    resources = recipe.resources.model_copy(
        update={"groups": groups.model_copy(update={"train": train}), "spot": "auto"}
    )
    text = render("sky", recipe.model_copy(update={"resources": resources}), "r.yaml")
    dag = dag_utils.load_job_group_from_yaml_str(text)
    first = dag.tasks[0]
    assert [(r.accelerators, r.use_spot) for r in first.resources] == [
        ({"H100": 8}, True),
        ({"A100-80GB": 8}, True),
        ({"H100": 8}, False),
        ({"A100-80GB": 8}, False),
    ]
    rollout = [(r.accelerators, r.use_spot) for r in dag.tasks[1].resources]
    engines = [{"L4": 4}, {"A10G": 4}, {"L40S": 4}]  # the recipe's set, spot before on-demand
    assert rollout == [(a, True) for a in engines] + [(a, False) for a in engines]


def test_dstack_reads_names_spot_policy_and_price():
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import parse_run_configuration

    config = parse_run_configuration(task_text(rendered(ALTERNATIVES, "dstack")))
    gpu = config.resources.gpu
    print("dstack gpu:", gpu, "spot_policy:", config.spot_policy, "max_price:", config.max_price)
    assert gpu.name == ["H100", "A100"]  # dstack's A100 with 80GB is SkyPilot's A100-80GB
    assert (gpu.count.min, gpu.count.max) == (8, 8)
    assert gpu.memory.min == 80 and gpu.memory.max is None
    assert config.spot_policy.value == "auto"
    assert config.max_price == 30.0
    assert [b.value for b in config.backends] == ["aws", "gcp"]
    assert config.regions == ["us-east-1", "us-central1"]


def test_dstack_spells_a_sized_name_its_way():
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import parse_run_configuration

    text = rendered(ALTERNATIVES, "dstack", accelerators="A100-80GB:8", spot=True, infra=None)
    config = parse_run_configuration(task_text(text))
    assert config.resources.gpu.name == ["A100"]
    assert config.resources.gpu.memory.min == config.resources.gpu.memory.max == 80
    assert config.spot_policy.value == "spot"


def test_dry_run_lists_the_alternatives_in_order():
    result = runner.invoke(app, ["launch", str(ALTERNATIVES), "-b", "sky", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    start = lines.index("8 alternatives, SkyPilot takes the first it can get:")
    assert [line.split()[1:] for line in lines[start + 1 : start + 9]] == [
        [gpu, spot, place]
        for spot in ("spot", "on-demand")
        for gpu in ("H100:8", "A100-80GB:8")
        for place in ("aws/us-east-1", "gcp/us-central1")
    ]
    assert lines[start + 9] == "at most $30 per node and hour"
    assert "SkyPilot takes" not in result.stdout  # stdout stays the file SkyPilot reads


@pytest.mark.parametrize(
    "backend,expected",
    [
        ("slurm", "error: resources.accelerators: Slurm takes one accelerator type"),
        ("local", "error: resources.max_hourly_cost: the local backend is this machine"),
    ],
    ids=["slurm", "local"],
)
def test_a_backend_refuses_what_it_cannot_express_in_one_line(backend: str, expected: str):
    result = runner.invoke(app, ["launch", str(ALTERNATIVES), "-b", backend, "--dry-run"])
    assert result.exit_code == 1
    assert expected in result.output
    assert "Traceback" not in result.output


def test_slurm_refuses_a_price_cap_and_places():
    from rlx.errors import RlxError

    with pytest.raises(RlxError, match=r"^resources.max_hourly_cost: a Slurm cluster has no"):
        rendered(ALTERNATIVES_SET, "slurm", max_hourly_cost=10.0)
    with pytest.raises(RlxError, match=r"^resources.infra: a Slurm job runs on its own cluster"):
        rendered(ALTERNATIVES_SET, "slurm", infra="aws")


def test_counts_that_differ_are_refused_by_dstack_and_slurm():
    from rlx.errors import RlxError

    mixed = {"H100:8": None, "A100-80GB:4": None}
    for backend, who in (("dstack", "dstack takes one GPU count"), ("slurm", "a Slurm job asks")):
        with pytest.raises(RlxError, match=f"^resources.accelerators: {who}.* 4 or 8"):
            rendered(ALTERNATIVES_SET, backend, accelerators=mixed)


def test_slurm_constraint_joins_the_recipes_own():
    recipe = load_recipe(ALTERNATIVES_SET).recipe
    assert recipe.slurm is not None
    slurm = recipe.slurm.model_copy(update={"constraint": "ib|roce"})
    text = render("slurm", recipe.model_copy(update={"slurm": slurm}), "r.yaml")
    assert "#SBATCH --constraint=[h100|a100]&(ib|roce)" in text.splitlines()


def test_lint_says_what_each_backend_cannot_take(write_recipe):
    text = ALTERNATIVES.read_text().replace(
        "dstack:\n  fleets: [gpu-cluster]",
        "dstack:\n  fleets: [gpu-cluster]\n  max_price: 12\n  backends: [aws]",
    )
    path = write_recipe(text + "sky: {infra: aws}\nslurm: {partition: gpu}\n")
    found = {(f.field, f.severity): f.message for f in lint_file(path)}
    assert found[("sky.infra", "error")].startswith("resources.infra says where to run")
    assert found[("dstack.max_price", "error")].startswith("resources.max_hourly_cost sets")
    assert found[("dstack.backends", "error")].startswith("resources.infra sets dstack's")
    # a price cap and places are for the clouds: lint warns, a Slurm launch refuses
    assert found[("resources.max_hourly_cost", "warning")].startswith("a Slurm cluster has no")
    assert found[("resources.accelerators", "error")].startswith("Slurm takes one accelerator")


def test_dstack_lint_names_an_unknown_gpu(write_recipe):
    pytest.importorskip("gpuhunt")
    path = write_recipe(ALTERNATIVES.read_text().replace("A100-80GB:8", "A100-96GB:8"))
    errors = [f for f in lint_file(path) if f.severity == "error"]
    # dstack's table and the plan's both lack it: each says so
    assert "dstack knows no GPU A100-96GB" in [f.message.split(";")[0] for f in errors]
    # a known name of another size: the sizes it comes in
    assert any("A100-96GB; A100 comes in 40GB or 80GB; write" in f.message for f in errors)


@pytest.mark.parametrize(
    ("written", "guess"),
    [("A10GG", "did you mean 'A10G' or 'A10' or 'A100'? "), ("H10O", "did you mean 'H100'? ")],
)
def test_dstack_lint_names_the_gpu_meant(written, guess, write_recipe):
    pytest.importorskip("gpuhunt")
    path = write_recipe(ALTERNATIVES.read_text().replace("A100-80GB:8", f"{written}:8"))
    said = [f.message for f in lint_file(path) if f.message.startswith("dstack knows no GPU")]
    assert said == [
        f"dstack knows no GPU {written}; {guess}write one of its names (H100, A100-80GB, L4, "
        "MI300X...: `dstack offer` lists them)"
    ]


def test_local_launch_ignores_accelerator_alternatives():
    recipe = load_recipe(ALTERNATIVES).recipe
    resources = recipe.resources.model_copy(update={"max_hourly_cost": None})
    text = render("local", recipe.model_copy(update={"resources": resources}), "r.yaml")
    assert "local backend" in text


def test_status_names_what_a_sky_cluster_got():
    from types import SimpleNamespace as NS

    from rlx.launchers.sky.ops import launched

    got = NS(accelerators={"A100-80GB": 8}, use_spot=True, cloud="GCP", region="us-central1")
    record = {"handle": NS(launched_resources=got), "cloud": None, "region": None}
    assert launched(record) == "A100-80GB:8 spot on gcp/us-central1"
    assert launched({"handle": None, "cloud": None}) == ""  # not launched yet: nothing said


def test_status_names_what_a_dstack_run_got():
    from types import SimpleNamespace as NS

    from rlx.launchers.dstack.ops import provisioned

    gpus = [NS(name="A100")] * 8
    data = NS(
        instance_type=NS(resources=NS(gpus=gpus, spot=False)),
        backend=NS(value="aws"),
        region="us-east-1",
        price=32.77,
    )
    master = NS(
        job_spec=NS(replica_num=0, job_num=0), job_submissions=[NS(job_provisioning_data=data)]
    )
    assert provisioned(NS(jobs=[master])) == "A100:8 on-demand on aws/us-east-1, $32.77/h"
    waiting = NS(job_spec=master.job_spec, job_submissions=[NS(job_provisioning_data=None)])
    assert provisioned(NS(jobs=[waiting])) == ""


def test_dstack_launch_refuses_an_unknown_gpu_without_a_dstack_section(write_recipe):
    pytest.importorskip("gpuhunt")
    text = ALTERNATIVES.read_text().replace("A100-80GB:8", "A100-96GB:8")
    path = write_recipe(text.replace("dstack:\n  fleets: [gpu-cluster]\n", ""))
    # the plan is told the GPU's size (custom hardware), so only dstack's table lacks it
    env = {"HF_TOKEN": "x", "RLX_ACCELERATOR_GIB": "A100-96GB=96"}
    result = runner.invoke(app, ["launch", str(path), "-b", "dstack"], env=env)
    assert result.exit_code == 1
    assert "error: resources.accelerators: dstack knows no GPU A100-96GB" in result.output
    assert "Traceback" not in result.output
