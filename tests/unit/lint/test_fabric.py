"""resources.fabric in lint: FSDP across nodes with no fabric named is a warning saying what
to write; a fabric the chosen SkyPilot infra or dstack backends cannot give is an error; a
key brought from SkyPilot is pointed at the recipe's field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlx.lint import lint_file
from tests.support.cli import invoke
from tests.support.recipes import write_shipped_variant


def variant(tmp_path: Path, source: str, **changes: Any) -> Path:
    return write_shipped_variant(tmp_path, source, **changes)


def findings(path: Path, field: str) -> list[str]:
    return [f"{f.severity}: {f.message}" for f in lint_file(path) if f.field == field]


def test_fsdp_across_nodes_without_a_fabric_warns(tmp_path: Path) -> None:
    path = variant(tmp_path, "grpo-large.yaml", resources__fabric=None)
    (warning,) = findings(path, "resources")
    assert warning.startswith("warning: FSDP's training ranks span 2 nodes and no fabric")
    assert "write fabric: efa (AWS EFA instances) or fabric: infiniband" in warning
    assert "fabric: tcp to say they have none" in warning
    assert "strategy auto" not in warning  # grpo-large asks for fsdp itself
    line = next(f.line for f in lint_file(path) if f.field == "resources")
    assert path.read_text().splitlines()[line - 1] == "resources:"


def test_auto_says_what_would_let_it_choose_ddp(tmp_path: Path) -> None:
    path = variant(tmp_path, "gsm8k-grpo.yaml", trainer__model__gradient_checkpointing=False)
    (warning,) = findings(path, "resources")
    assert "(strategy auto chose FSDP as DDP leaves no 10% spare on a GPU: gradient" in warning


@pytest.mark.parametrize(
    ("source", "changes"),
    [
        ("grpo-large.yaml", {}),  # efa named
        ("grpo-large.yaml", {"resources__fabric": "tcp"}),  # none, knowingly
        ("ppo-7b.yaml", {"resources__fabric": None}),  # 8 ranks on one node
        ("gsm8k-grpo.yaml", {}),  # auto replicates (DDP) across the two nodes
        ("grpo-large.yaml", {"resources__fabric": None, "trainer__parallel__strategy": "ddp"}),
        ("quickstart.yaml", {"resources__nodes": 2}),  # CPU ranks
    ],
)
def test_no_warning(tmp_path: Path, source: str, changes: dict[str, Any]) -> None:
    assert findings(variant(tmp_path, source, **changes), "resources") == []


def test_sky_infra_must_give_the_fabric(tmp_path: Path) -> None:
    gcp = variant(tmp_path, "grpo-large.yaml", sky__infra="gcp/us-central1")
    (error,) = findings(gcp, "sky.infra")
    assert error == (
        "error: SkyPilot's network_tier: best gives efa only on aws or k8s, and this recipe "
        "runs on gcp/us-central1; set infra: aws, or name the fabric these nodes have "
        "(resources.fabric)"
    )
    aws_ib = variant(tmp_path, "grpo-large.yaml", resources__fabric="infiniband")
    assert findings(aws_ib, "sky.infra")[0].startswith(
        "error: SkyPilot's network_tier: best gives infiniband only on nebius or k8s"
    )
    for infra in ("aws/us-east-1", "k8s", None):
        assert findings(variant(tmp_path, "grpo-large.yaml", sky__infra=infra), "sky.infra") == []
    nebius = variant(
        tmp_path, "grpo-large.yaml", resources__fabric="infiniband", sky__infra="nebius"
    )
    assert findings(nebius, "sky.infra") == []


def test_dstack_backends_must_hold_aws_for_efa(tmp_path: Path) -> None:
    gcp = variant(tmp_path, "ppo-7b.yaml", dstack__backends=["gcp"])
    (error,) = findings(gcp, "dstack.backends")
    assert error.startswith("error: fabric: efa is AWS's, and these backends (gcp) leave AWS")
    both = variant(tmp_path, "ppo-7b.yaml", dstack__backends=["gcp", "aws"])
    assert findings(both, "dstack.backends") == []


def test_skypilot_network_tier_points_at_the_recipe_field(write_recipe) -> None:
    path = write_recipe("name: job\nresources:\n  nodes: 2\n  network_tier: best\n")
    (error,) = findings(path, "resources.network_tier")
    assert error == "error: unknown field 'network_tier'; in a recipe this is 'resources.fabric'"
    typo = write_recipe("name: job\nresources:\n  fabrik: efa\n", "typo.yaml")
    assert findings(typo, "resources.fabrik") == [
        "error: unknown field 'fabrik'; did you mean 'fabric'?"
    ]
    value = write_recipe("name: job\nresources:\n  fabric: ib\n", "value.yaml")
    (bad,) = findings(value, "resources.fabric")
    assert "write one of 'efa', 'infiniband' or 'tcp'" in bad


def test_auto_micro_batch_across_nodes_is_a_decision_not_a_traceback(tmp_path: Path) -> None:
    # the strategy rule plans DDP with the micro-batch auto chooses, never with "auto"
    path = variant(tmp_path, "gsm8k-grpo.yaml", trainer__batch__micro_batch_size="auto")
    (warning,) = findings(path, "resources")
    assert warning.startswith("warning: FSDP's training ranks span 2 nodes and no fabric")
    assert invoke(["lint", str(path)]).exit_code == 0
    for backend in ("sky", "dstack", "slurm", "ray"):
        result = invoke(["render", str(path), "-b", backend])
        assert result.exit_code == 0, (backend, result.output)
    result = invoke(["launch", "--dry-run", str(path)])
    assert result.exit_code == 0, result.output


def test_auto_says_why_only_where_ddp_was_planned(tmp_path: Path) -> None:
    # a GPU the table lacks: DDP has no plan, so no claim that it leaves no spare
    path = variant(tmp_path, "gsm8k-grpo.yaml", resources__accelerators="A10GG:1")
    (warning,) = findings(path, "resources")
    assert warning.startswith("warning: FSDP's training ranks span 2 nodes and no fabric")
    assert "strategy auto chose FSDP" not in warning
