"""Exact resume: 6 steps straight equal 3 steps, a kill, and 3 resumed steps, metric for
metric and bit for bit; a kill in the middle of a checkpoint save falls back to the
previous complete checkpoint. Each run is a real `rlx train` process with its own Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlx.trainer.checkpoint import MARKER
from rlx.trainer.metrics import read_metrics

from .helpers import write_recipe
from .runner import run_rlx

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)

# Values that depend only on the seed and the data, not on the clock or the machine's load.
DETERMINISTIC = (
    "reward/mean",
    "reward/std",
    "kl",
    "approx_kl",
    "clipfrac",
    "entropy",
    "grad_norm",
    "critic/grad_norm",
    "loss/policy",
    "loss/value",
    "value/explained_variance",
    "value/mean",
    "response_length/mean",
    "lr",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def recipe(workdir: Path) -> Path:
    """PPO with a KL penalty in the reward, two epochs of two minibatches: every kind of
    state (policy, critic, two optimisers, schedules, sampler, shuffling) must come back."""
    return write_recipe(
        workdir,
        "resume-test",
        algorithm="ppo",
        algo={"kl": {"coef": 0.05, "mode": "reward"}},
        optim={"critic_lr": 2.0e-3, "schedule": "cosine", "warmup_steps": 2},
        rollout={"n": 4, "max_new_tokens": 16},
        batch={"prompts_per_step": 4, "minibatch_size": 8, "micro_batch_size": 4, "ppo_epochs": 2},
        steps=6,
        checkpoint={"dir": str(workdir / "ckpt"), "every": 3, "keep": 3},
    )


def train(recipe: Path, run_id: str, **env: str):
    return run_rlx(["train", str(recipe)], recipe.parent, RLX_RUN_ID=run_id, **env)


@pytest.fixture(scope="module")
def straight(recipe: Path, workdir: Path) -> Path:
    result = train(recipe, "straight")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "ckpt" / "straight"


def assert_same_run(workdir: Path, run_id: str, straight: Path) -> None:
    want = read_metrics(workdir / "runs" / "straight" / "metrics.jsonl")
    got = read_metrics(workdir / "runs" / run_id / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for expected, actual in zip(want, got, strict=True):
        for key in DETERMINISTIC:
            assert actual.get(key) == expected.get(key), (actual["step"], key)
    assert "kl" in got[-1] and "value/explained_variance" in got[-1]  # PPO + KL really ran
    final = workdir / "ckpt" / run_id / "step-000006"
    for part in ("policy", "critic"):
        ours = load_file(final / f"{part}.safetensors")
        theirs = load_file(straight / "step-000006" / f"{part}.safetensors")
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), (part, name)
    ours_opt = torch.load(final / "optimizer.pt", weights_only=True)["state"]
    theirs_opt = torch.load(straight / "step-000006" / "optimizer.pt", weights_only=True)["state"]
    for index, state in theirs_opt.items():
        assert torch.equal(ours_opt[index]["exp_avg_sq"], state["exp_avg_sq"])


def test_kill_after_a_checkpoint_then_resume_is_exact(recipe, workdir, straight) -> None:
    killed = train(recipe, "killed", RLX_TEST_KILL_AT="step:3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    metrics = read_metrics(workdir / "runs" / "killed" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    resumed = train(recipe, "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-000003 (step 3)" in resumed.stdout
    assert_same_run(workdir, "killed", straight)
    state = json.loads((workdir / "runs" / "killed" / "result.json").read_text())
    assert state["state"] == "SUCCEEDED" and state["last_step"] == 6


def test_a_kill_during_a_save_resumes_from_the_previous_checkpoint(recipe, workdir, straight):
    crashed = train(recipe, "crashed", RLX_TEST_KILL_AT="save:6:renamed")
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert "a training worker died" in crashed.stderr
    assert "Traceback" not in crashed.stderr
    folder = workdir / "ckpt" / "crashed"
    assert (folder / "step-000006").is_dir() and not (folder / "step-000006" / MARKER).exists()
    resumed = train(recipe, "crashed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-000003 (step 3)" in resumed.stdout
    assert_same_run(workdir, "crashed", straight)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000003", "step-000006"]
