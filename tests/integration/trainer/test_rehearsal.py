"""The dress rehearsal of every shipped GPU recipe: exactly as shipped but for the model's size
and the accelerators (`rlx rehearse`): a stand-in model of the same architecture under the
recipe's own hub id, served offline from a hub cache; stand-in GPUs on Ray nodes of this
machine (training ranks and engines placed as on GPUs, computing on CPU); the recipe's own
layout, strategy, engines (vLLM's CPU build), node groups, staleness, reward or environment,
data layout, storage (real S3 and GCS servers started here, the recipes' own buckets),
checkpoints and probe. Each trains steps 1-2 and checkpoints; the recipes whose resume differs
in kind (RESUMED) then resume as a retried job would and train step 3. The rehearsals one
worker of `make test` runs share one Ray cluster (three nodes: two stand-in GPUs labelled
train, two and one labelled rollout), its nodes started with the hub cache and the stores in
their environment, as a cloud node would have them; each rehearsal is a unit of the schedule
of its own (tests/support/schedule.py), so the workers share them out.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlx.node.env import environment
from rlx.recipe import load_recipe
from rlx.trainer.rehearsal import (
    CHECKPOINT_STEP,
    RayNode,
    plan_rehearsal,
    ray_nodes,
    rehearse,
)
from tests.conftest import RECIPES
from tests.support.rehearsal import write_workdir
from tests.support.stores import gcs_server, s3_server

pytest.importorskip("ray")
pytest.importorskip("vllm", reason="the rehearsals run vLLM's CPU build")
pytestmark = pytest.mark.timeout(1500)


def _asks_for_gpus(path: Path) -> bool:
    resources = yaml.safe_load(path.read_text()).get("resources") or {}
    groups = (resources.get("groups") or {}).values()
    return any(part.get("accelerators") for part in (resources, *groups))


# Every shipped recipe that asks for GPUs.
GPU_RECIPES = tuple(sorted(path.stem for path in RECIPES.glob("*.yaml") if _asks_for_gpus(path)))
# The recipes that also resume: each brings back state of a kind no other one does (a critic
# and tensor-parallel engines from S3; rollouts played ahead at max_staleness 1 on node
# groups; a LoRA adapter from GCS). The others resume nothing these do not (gsm8k-grpo's,
# -dapo's and -tools' colocated ranks are gsm8k-lora-7b's store and ppo-7b's ranks; a resume's
# dynamic sampling and episodes are tests of their own: test_dynamic_sampling, test_episodes).
RESUMED = ("grpo-async", "gsm8k-lora-7b", "ppo-7b")
S3_BUCKETS = ("rlx-ppo-7b", "rlx-grpo-large", "rlx-grpo-async")
GCS_BUCKETS = ("rlx-gsm8k", "rlx-gsm8k-lora")


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The recipes' working folder (their data), their buckets in real S3 and GCS servers,
    a hub cache, and one Ray cluster whose nodes have all of it in their environment."""
    folder = write_workdir(tmp_path_factory.mktemp("rehearsal"))
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(s3_server())
        gcs = stack.enter_context(gcs_server())
        for bucket in S3_BUCKETS:
            s3.filesystem().mkdir(bucket)
        for bucket in GCS_BUCKETS:
            gcs.filesystem().mkdir(bucket)
        hub = folder / "hub"
        values = {
            **s3.env,
            **gcs.env,
            "HF_HUB_CACHE": str(hub),
            "HF_HUB_OFFLINE": "1",
            "RLX_STAGING_DIR": str(folder / "staging"),  # every node's local disk
            "RAY_AUTH_MODE": "disabled",
        }
        stack.enter_context(environment(values))
        stack.enter_context(contextlib.chdir(folder))  # the recipes' relative data paths
        nodes = [RayNode(2, "train"), RayNode(2, "rollout"), RayNode(1, "rollout")]
        address = stack.enter_context(ray_nodes(nodes))
        yield {"folder": folder, "hub": hub, "address": address, "s3": s3, "gcs": gcs}


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_a_shipped_gpu_recipe_gets_through_steps_a_checkpoint_and_a_resume(name, stage) -> None:
    recipe = load_recipe(RECIPES / f"{name}.yaml").recipe
    resume = name in RESUMED
    result = rehearse(
        recipe,
        env=dict(os.environ),
        address=stage["address"],
        hub_cache=stage["hub"],
        run_id=f"{name}-rehearsal",
        resume=resume,
    )
    assert result.passed, result.runs
    assert result.runs[0].steps_logged == [1, CHECKPOINT_STEP]
    assert len(result.runs) == (2 if resume else 1)
    if resume:
        assert result.runs[1].steps_logged == [1, 2, 3]
    # The strategy its GPU run chooses, and the stand-in under the recipe's own hub id.
    assert result.plan.strategy is not None
    assert result.plan.models.keys() == {recipe.trainer.model.path}
    # The checkpoints are in the recipe's own bucket, the step saved before the resume too.
    assert result.checkpoints is not None
    store = stage["gcs"] if result.checkpoints.startswith("gs://") else stage["s3"]
    steps = sorted(p.rsplit("/", 1)[-1] for p in store.filesystem().ls(result.checkpoints))
    saved = ["step-000002", "step-000003"] if resume else ["step-000002"]
    assert steps[-len(saved) :] == saved, steps
    log = Path(stage["folder"], "staging", "runs", result.run_id, "train.log").read_text()
    assert "weights of step 0 proven on every engine" in log
    assert (f"resumed from {result.checkpoints}/step-000002 (step 2)" in log) == resume


def test_what_a_rehearsal_changes_is_said_and_a_missing_file_stops_it(stage) -> None:
    recipe = load_recipe(RECIPES / "ppo-7b.yaml").recipe
    plan = plan_rehearsal(recipe)
    changed = {path: (was, now) for path, was, now in plan.changes}
    assert changed["resources.accelerators"] == ("H100:8", "H100:2")
    assert changed["trainer.rollout_gpus"] == ("8", "2")
    assert "trainer.algorithm" not in changed and "trainer.layout" not in changed
    data = recipe.trainer.data.model_copy(update={"train": "data/none.parquet"})
    broken = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"data": data})})
    result = rehearse(broken, address=stage["address"], hub_cache=stage["hub"], run_id="none")
    assert not result.passed and len(result.runs) == 1
    assert result.runs[0].error is not None
    assert result.runs[0].error.startswith("trainer.data.train: data/none.parquet does not exist")
