"""Weight sync with rollout engines in their own actors (layout: split, on CPU): each step
pushes the policy's weights once and proves them on every engine; an engine that misses a
push, or holds other weights under the right version, stops the run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from rlx.trainer.main import trainer_for
from rlx.trainer.rollout.colocated import make_colocated_engine
from rlx.trainer.rollout.probe import StaleEngineError, check_engines
from tests.support.recipes import make_recipe

pytestmark = pytest.mark.timeout(600)


def test_split_engines_get_every_update_and_a_stale_one_stops_the_run(tmp_path: Path, local_ray):
    ray = local_ray
    recipe = make_recipe(
        tmp_path,
        layout="split",
        rollout_gpus=2,  # on CPU: two rollout actors
        rollout={"n": 4, "max_new_tokens": 16},
        batch={"prompts_per_step": 3, "micro_batch_size": 12},
        steps=5,
    )
    env = {"RLX_RUN_ID": "split"}
    out = io.StringIO()
    with trainer_for(recipe, env, out) as trainer:
        cluster = trainer.cluster
        assert len(cluster.rollout.handles) == 2 and len(cluster.train.handles) == 1
        assert trainer.resume() == 0  # also proves the engines start at version 0
        probe = trainer.inputs.probe
        tolerance = probe.tolerance("float32")

        # Prompts are split over the engines (2 + 1) and come back grouped in prompt order.
        prompts = [trainer.inputs.data.prompt_token_ids[i] for i in range(3)]
        rollout = cluster.generate(prompts, step=99, show_progress=False)
        assert rollout.prompt_ids == [p for p in prompts for _ in range(4)]

        before = None
        for step in (1, 2):
            metrics = trainer.step(step)
            assert metrics["sync/probe_diff"] <= tolerance
            reports = ray.get([r.report.remote(probe) for r in cluster.rollout.handles])
            assert [r.version for r in reports] == [step, step]
            value = reports[0].probe_logprob
            assert value != before  # the update moved the weights the engines score with
            before = value
            if step == 1:
                old_weights = full_weights(ray, cluster.train.handles[0])

        # Right version, wrong weights: the probe catches it.
        report = ray.get(cluster.rollout.handles[0].load_weights.remote(old_weights, 2, probe))
        policy = ray.get(cluster.train.handles[0].policy_probe.remote(probe))
        with pytest.raises(StaleEngineError, match="its weights are not the policy's"):
            check_engines([report], 2, policy, tolerance)

        # Small buckets: a push is many broadcasts, each landing on both engines.
        cluster.bucket_bytes = 40_000
        assert len(cluster.push_layouts()) > 3
        assert trainer.step(3)["sync/probe_diff"] <= tolerance

        # One bucket lost on the way to an engine: the push is partial and the run stops.
        ray.get(cluster.rollout.handles[0].drop_next_buckets.remote(1))
        with pytest.raises(
            StaleEngineError,
            match=r"rollout engine 0 \(node .*\) received (\d+) of the (\d+) tensors of "
            r"weights version 4: the push was partial",
        ):
            trainer.step(4)

        # Engine 0 still holds version 3: its samples would be refused by the staleness
        # check of step 5 (test_async.py). A complete push puts every engine back in step.
        cluster.sync_weights(4, probe)

        # A push that never arrives: the next step fails naming the engine.
        ray.get(cluster.rollout.handles[1].skip_next_pushes.remote(1))
        with pytest.raises(
            StaleEngineError,
            match=r"rollout engine 1 \(node .*\) holds weights version 4 but the policy is at "
            r"version 5: the weight push did not arrive",
        ):
            trainer.step(5)


def full_weights(ray, worker) -> dict[str, torch.Tensor]:
    """The policy's parameters, whole."""
    state = ray.get(worker.policy_state.remote())
    assert state is not None
    return state


def test_colocated_hf_engine_is_the_policy_module(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    colocated = make_colocated_engine(
        "hf", policy, str(tiny_model_dir), dtype="float32", options={}
    )
    assert colocated.engine.model is policy  # no copy: updates are seen without a push
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    colocated.refresh(policy, 7)
    assert colocated.engine.weight_version == 7
