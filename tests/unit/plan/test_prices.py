"""`rlx plan`'s hourly prices: from a price file of SkyPilot's columns (this test's own figures,
tests/prices/prices.csv) or SkyPilot's catalog cache, the cheapest offer that fits each kind
of node in the recipe's places, per node and for the cluster, spot and on-demand; one line
without price data (never a figure of its own), one line and exit 1 for a bad price file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.plan.prices import NO_PRICES, load_prices, price_alternatives, read_offers
from rlx.plan.report import price_lines
from rlx.recipe import load_recipe
from rlx.recipe.load import parse_recipe
from tests.conftest import RECIPES, REPO
from tests.support.cli import assert_one_line_error

PRICES = REPO / "tests" / "prices" / "prices.csv"
runner = CliRunner()


@pytest.fixture(autouse=True)
def no_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SkyPilot's catalog cache lives under SKY_RUNTIME_DIR: empty unless a test fills it."""
    home = tmp_path / "sky-home"
    home.mkdir()
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(home))
    return home


def planned(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_price_file_prices_every_alternative_per_node_and_cluster():
    prices = planned(str(RECIPES / "ppo-7b.yaml"), "--prices", str(PRICES))["prices"]
    assert prices["source"] == str(PRICES)
    h100, a100 = prices["alternatives"]
    (node,) = h100["nodes"]
    assert (node["nodes"], node["accelerator"]) == (2, "H100:8")
    # the cheapest on-demand and the cheapest spot offer, each where it is
    assert node["on_demand"] == {
        "per_node": 100.0,
        "instance_type": "p5.48xlarge",
        "where": "p5.48xlarge us-east-1",
    }
    assert node["spot"]["per_node"] == 35.0 and node["spot"]["where"].endswith("us-west-2")
    assert (h100["cluster_on_demand"], h100["cluster_spot"]) == (200.0, 70.0)
    # no spot price in the file: none, not a figure of rlx's own
    assert a100["nodes"][0]["spot"] is None and a100["cluster_spot"] is None
    assert a100["cluster_on_demand"] == 120.0


def test_offers_must_fit_the_node_and_the_places():
    # gsm8k-grpo asks for 8+ vCPUs and 32+ GB: g6.xlarge (4 vCPUs) is cheaper and left out;
    # a row with no instance type (a GPU priced apart from its machine) is left out too
    recipe = load_recipe(RECIPES / "gsm8k-grpo.yaml").recipe
    (alternative,) = price_alternatives(recipe, load_prices(PRICES))
    (node,) = alternative.nodes
    assert node.on_demand.instance_type == "g6.2xlarge" and node.on_demand.price == 1.0
    assert alternative.cluster(spot=False) == 2.0 and alternative.cluster(spot=True) == 0.8
    west = parse_recipe(
        "name: west\nresources: {nodes: 3, accelerators: 'L4:1', cpus: '8', "
        "infra: aws/us-west-2}\ncommand: [echo]\n"
    ).recipe
    (alternative,) = price_alternatives(west, load_prices(PRICES))
    assert alternative.nodes[0].on_demand.where == "g6.2xlarge us-west-2"
    assert alternative.cluster(spot=False) == pytest.approx(3.6)


def test_groups_add_up_and_an_unpriced_kind_leaves_the_cluster_unpriced():
    recipe = load_recipe(RECIPES / "grpo-async.yaml").recipe
    priced = {p.label: p for p in price_alternatives(recipe, load_prices(PRICES))}
    l4 = priced["train A100-80GB:8 + rollout L4:4"]
    assert [(n.group, n.nodes) for n in l4.nodes] == [("train", 1), ("rollout", 2)]
    assert l4.cluster(spot=False) == 60.0 + 2 * 5.0
    assert priced["train H100:8 + rollout L40S:4"].cluster(spot=False) is None
    lines = price_lines(list(priced.values()), "f.csv")
    assert "  train A100-80GB:8 + rollout L4:4: cluster $70.00 on-demand, spot not priced" in lines
    assert "    rollout 2 x L40S:4, per node: on-demand not priced, spot not priced" in lines


def test_skypilots_catalog_cache_newest_version(no_catalog: Path):
    for version, price in (("v7", "1.00"), ("v8", "2.00")):
        folder = no_catalog / ".sky" / "catalogs" / version / "aws"
        folder.mkdir(parents=True)
        text = PRICES.read_text().replace("1.00,0.40,us-east-1", f"{price},0.40,us-east-1")
        (folder / "vms.csv").write_text(text)
    shutil.copytree(no_catalog / ".sky/catalogs/v8/aws", no_catalog / ".sky/catalogs/v8/lambda")
    # ppo-7b runs on aws (resources.infra): only that cloud's catalog
    prices = planned(str(RECIPES / "ppo-7b.yaml"))["prices"]
    assert prices["source"].endswith("catalogs/v8 (aws, lambda)")
    (node,) = prices["alternatives"][0]["nodes"]
    assert node["on_demand"]["where"] == "p5.48xlarge aws/us-east-1"
    # anywhere: the newest catalog's cheapest (v8's us-east-1 is 2.00: us-west-2 wins)
    anywhere = parse_recipe(
        "name: any\nresources: {accelerators: 'L4:1', cpus: '8'}\ncommand: [echo]\n"
    ).recipe
    (alternative,) = price_alternatives(anywhere, load_prices(None))
    assert alternative.nodes[0].on_demand.price == 1.2
    assert alternative.nodes[0].on_demand.where == "g6.2xlarge aws/us-west-2"
    on_lambda = anywhere.model_copy(
        update={"resources": anywhere.resources.model_copy(update={"infra": "lambda"})}
    )
    (alternative,) = price_alternatives(on_lambda, load_prices(None))
    assert alternative.nodes[0].on_demand.cloud == "lambda"


def test_without_price_data_one_line_and_no_figure():
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-grpo.yaml")])
    assert result.exit_code == 0, result.output
    assert NO_PRICES in result.stdout and "$" not in result.stdout
    assert result.stdout.count("prices: none") == 1
    assert planned(str(RECIPES / "gsm8k-grpo.yaml"))["prices"] == {"missing": NO_PRICES}
    # a CPU-only recipe has no accelerator to price: nothing said
    cpu = runner.invoke(app, ["plan", str(RECIPES / "quickstart.yaml")])
    assert "prices" not in cpu.stdout


@pytest.mark.parametrize(
    "text,says",
    [
        ("InstanceType,AcceleratorName,Price\np5.48xlarge,H100,1\n", "missing AcceleratorCount"),
        (
            "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"
            "p5,H100,8,cheap,,us\n",
            ":2: Price 'cheap' is not a number",
        ),
        (
            "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"
            "p5,H100,8,-3,,us\n",
            ":2: Price '-3' is negative",
        ),
    ],
    ids=["missing-columns", "not-a-number", "negative"],
)
def test_a_bad_price_file_is_one_line(text: str, says: str, tmp_path: Path):
    path = tmp_path / "prices.csv"
    path.write_text(text)
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-grpo.yaml"), "--prices", str(path)])
    assert_one_line_error(result, f"{path}", says)


def test_a_missing_price_file_is_one_line(tmp_path: Path):
    missing = tmp_path / "none.csv"
    result = runner.invoke(
        app, ["plan", str(RECIPES / "gsm8k-grpo.yaml"), "--prices", str(missing)]
    )
    assert_one_line_error(result, f"{missing}: cannot read the price file")


def test_rows_without_a_machine_are_left_out_and_cpu_machines_kept():
    offers = read_offers(PRICES)
    assert all(o.instance_type for o in offers)
    assert len(offers) == 8
    (cpu,) = [o for o in offers if not o.accelerator]
    assert (cpu.instance_type, cpu.count, cpu.price) == ("m5.xlarge", 0.0, 0.2)
    # a CPU recipe is priced by its CPU machines (rlx status); plan prints no prices for it
    (alternative,) = price_alternatives(
        load_recipe(RECIPES / "quickstart.yaml").recipe, load_prices(PRICES)
    )
    assert alternative.nodes[0].accelerator == "CPU"
    assert alternative.cluster(spot=False) == 0.2


CHOICE = """\
name: choice
resources:
  nodes: 2
  accelerators: {accelerators}
  spot: {spot}
trainer:
  algorithm: grpo
  model: {{path: Qwen/Qwen2.5-0.5B-Instruct}}
  data: {{train: synthetic:letters_or_digits}}
  reward: {{function: letters_or_digits}}
  batch: {{prompts_per_step: 16, micro_batch_size: 2}}
"""


def choice_recipe(tmp_path: Path, accelerators: str, spot: str = "false") -> Path:
    path = tmp_path / "choice.yaml"
    path.write_text(CHOICE.format(accelerators=accelerators, spot=spot))
    return path


def test_plan_says_when_an_alternative_that_fits_is_cheaper(tmp_path: Path):
    path = choice_recipe(tmp_path, "[H100:8, A100-80GB:8]")
    result = runner.invoke(app, ["plan", str(path), "--prices", str(PRICES)])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("cheaper:")]
    assert "A100-80GB:8 fits too and costs $120.00 an hour on-demand" in line
    assert "$200.00 for the first preference H100:8" in line
    out = planned(str(path), "--prices", str(PRICES))["prices"]
    assert out["cheaper"].startswith("A100-80GB:8 fits too")
    # the cheaper one first: nothing to say
    first = choice_recipe(tmp_path, "[A100-80GB:8, H100:8]")
    assert planned(str(first), "--prices", str(PRICES))["prices"]["cheaper"] is None


def test_cheaper_choice_compares_what_the_recipe_pays(tmp_path: Path):
    from rlx.plan.prices import cheaper_choice

    prices = load_prices(PRICES)

    def says(accelerators: str, spot: str = "false", fitting=("H100:8", "A100-80GB:8")):
        recipe = load_recipe(choice_recipe(tmp_path, accelerators, spot)).recipe
        return cheaper_choice(recipe, price_alternatives(recipe, prices), set(fitting), "f")

    assert says("[H100:8, A100-80GB:8]") is not None
    # a set is no preference: the backend picks
    assert says("{H100:8, A100-80GB:8}") is None
    # spot only: the A100 machine has no spot price, so nothing to compare
    assert says("[H100:8, A100-80GB:8]", spot="true") is None
    # one that does not fit is no choice
    assert says("[H100:8, A100-80GB:8]", fitting=("H100:8",)) is None


def test_lint_warns_with_prices_and_says_nothing_of_cost_without(tmp_path: Path, no_catalog: Path):
    path = choice_recipe(tmp_path, "[H100:8, A100-80GB:8]")
    without = runner.invoke(app, ["lint", "--strict", str(path)])
    assert without.exit_code == 0, without.output
    assert "cheaper" not in without.output and "$" not in without.output
    priced = runner.invoke(app, ["lint", "--strict", str(path), "--prices", str(PRICES)])
    assert priced.exit_code == 1, priced.output
    (warning,) = [line for line in priced.stdout.splitlines() if "fits too" in line]
    assert ": warning: resources.accelerators: A100-80GB:8 fits too" in warning
    # SkyPilot's catalog cache, once it is on the machine, is prices too
    folder = no_catalog / ".sky" / "catalogs" / "v8" / "aws"
    folder.mkdir(parents=True)
    shutil.copyfile(PRICES, folder / "vms.csv")
    cached = runner.invoke(app, ["lint", str(path)])
    assert cached.exit_code == 0 and "catalogs/v8 (aws)" in cached.stdout, cached.output
    bad = tmp_path / "bad.csv"
    bad.write_text("InstanceType\n")
    assert_one_line_error(
        runner.invoke(app, ["lint", str(path), "--prices", str(bad)]), "missing AcceleratorName"
    )
