"""Checkpoints in one process: exact resume, part formats, rotation, the markers a complete
checkpoint carries, run ids and what to resume from (across processes:
tests/integration/trainer/test_checkpoint_processes.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from rlx.errors import RlxError
from rlx.trainer.checkpoint import (
    MARKER,
    CheckpointManager,
    capture_rng_state,
    read_marker,
    resolve_resume,
    resolve_run_id,
    restore_rng_state,
    sanitize_run_id,
)

# --------------------------------------------------------------------------- exact resume


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # Dropout makes the forward pass draw from torch's RNG, so RNG state matters.
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 1))


def make_optim(
    model: nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return optimizer, scheduler


def train(model: nn.Module, optimizer: Any, scheduler: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)  # (B, D)
        scale = random.random()
        noise = float(np.random.standard_normal())
        target = x.sum(dim=1, keepdim=True) * scale + noise  # (B, 1)
        loss = (model(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_resume_continues_bitwise(tmp_path: Path) -> None:
    seed_everything(0)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    history = train(model, optimizer, scheduler, 3)
    manager = CheckpointManager(tmp_path, "run", keep=2)
    saved = manager.save(
        3,
        {
            "policy": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng_state(),
            "trainer_state": {"losses": history},
        },
    )
    train(model, optimizer, scheduler, 3)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}

    def restored(with_rng: bool) -> dict[str, torch.Tensor]:
        seed_everything(1234)  # a different stream, which the restore must override
        other = make_model(99)
        other_optimizer, other_scheduler = make_optim(other)
        state = manager.load(manager.latest())
        other.load_state_dict(state["policy"])
        other_optimizer.load_state_dict(state["optimizer"])
        other_scheduler.load_state_dict(state["scheduler"])
        if with_rng:
            restore_rng_state(state["rng"])
        assert state["step"] == 3
        assert state["trainer_state"] == {"losses": history}
        train(other, other_optimizer, other_scheduler, 3)
        return {name: p.detach().clone() for name, p in other.named_parameters()}

    assert manager.latest() == saved
    resumed = restored(with_rng=True)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name
    # Control: without the RNG the continuation differs, so the check above has teeth.
    unseeded = restored(with_rng=False)
    assert any(not torch.equal(unseeded[name], value) for name, value in expected.items())


def test_rng_state_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    seed_everything(7)
    manager = CheckpointManager(tmp_path, "run", keep=1)
    manager.save(1, {"rng": capture_rng_state()})
    draws = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    seed_everything(8)
    restore_rng_state(manager.load(manager.latest())["rng"])
    again = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    assert again == draws


# --------------------------------------------------------------------------- formats


def test_each_part_gets_the_format_that_fits(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=1)
    embedding = torch.randn(5, 3)
    weights = {
        "embed": embedding,
        "lm_head": embedding,  # tied: shares storage with embed
        "transposed": torch.randn(3, 4).t(),  # not contiguous
        "half": torch.randn(2, 2).to(torch.bfloat16),
    }
    optimizer_like = {
        "state": {0: {"step": torch.tensor(3.0)}},
        "param_groups": [{"betas": (0.9, 0.99)}],
    }
    history = {"reward": [0.5, math.nan, 1.0], "note": "x"}
    path = manager.save(
        5, {"policy": weights, "optimizer": optimizer_like, "trainer_state": history}
    )

    assert sorted(p.name for p in path.iterdir()) == [
        MARKER,
        "optimizer.pt",
        "policy.safetensors",
        "trainer_state.json",
    ]
    assert json.loads((path / "trainer_state.json").read_text())["note"] == "x"
    loaded = manager.load(path)
    for name, value in weights.items():
        assert torch.equal(loaded["policy"][name], value), name
        assert loaded["policy"][name].dtype == value.dtype
    assert loaded["optimizer"]["state"][0]["step"].item() == 3.0  # int keys survive
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert loaded["trainer_state"]["reward"][0] == 0.5
    assert math.isnan(loaded["trainer_state"]["reward"][1])
    marker = read_marker(path)
    assert marker is not None and marker["step"] == 5
    assert {f["name"] for f in marker["files"]} == {
        "optimizer.pt",
        "policy.safetensors",
        "trainer_state.json",
    }
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in marker["files"])


def test_unloadable_part_is_refused_at_save_and_leaves_nothing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=3)
    first = manager.save(1, {"data": {"position": 3}})
    with pytest.raises(TypeError, match=r"'sampler'\['order'\].*numpy"):
        manager.save(2, {"sampler": {"order": np.arange(4), "epoch": 1}})
    assert manager.latest() == first
    assert [p.name for p in manager.run_dir.iterdir()] == [first.name]


@pytest.mark.parametrize("name", ["step", MARKER, "../escape", ".hidden", ""])
def test_bad_part_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="part name"):
        CheckpointManager(tmp_path, "run", keep=1).save(1, {name: {"a": 1}})


def test_damaged_files_are_reported_on_load(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=1)
    path = manager.save(1, {"policy": {"w": torch.arange(1000.0)}, "meta": {"a": 1}})
    tensor_file = path / "policy.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(RlxError, match=r"policy\.safetensors does not match its checksum"):
        manager.load(path)
    assert manager.load(path, verify=False)["meta"] == {"a": 1}
    tensor_file.write_bytes(bytes(data[:-10]))
    with pytest.raises(RlxError, match="missing or truncated"):
        manager.load(path)


def test_a_marker_must_be_valid_and_name_its_own_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=5)
    path = manager.save(4, {"meta": {"a": 1}})
    marker = (path / MARKER).read_text()
    (path / MARKER).write_text(marker.replace('"step": 4', '"step": 5'))
    assert read_marker(path) is None
    (path / MARKER).write_text("{truncated")
    assert read_marker(path) is None
    assert manager.latest() is None
    with pytest.raises(RlxError, match="not a complete checkpoint"):
        manager.load(path)


# --------------------------------------------------------------------------- rotation


def test_keeps_the_newest_n(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=2)
    for step in range(1, 6):
        manager.save(step * 10, {"meta": {"step": step}})
    assert [p.name for p in manager.checkpoints()] == ["step-000040", "step-000050"]
    assert sorted(p.name for p in manager.run_dir.iterdir()) == ["step-000040", "step-000050"]
    assert manager.load(manager.latest())["meta"] == {"step": 5}


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=3)
    for step in (10, 20, 30):
        manager.save(step, {"meta": {"history": "old"}})
    # Resumed from step 10: the new history saves 20 again; old 20 and 30 must not win.
    manager.save(20, {"meta": {"history": "new"}})
    assert [p.name for p in manager.checkpoints()] == ["step-000010", "step-000020"]
    assert manager.load(manager.latest())["meta"] == {"history": "new"}


def test_large_steps_sort_numerically(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=2)
    manager.save(999_999, {"meta": {}})
    manager.save(1_000_000, {"meta": {}})
    assert manager.latest() is not None and manager.latest().name == "step-1000000"


# --------------------------------------------------------------------------- crashes


# --------------------------------------------------------------------------- run id, resume


def test_run_id_order() -> None:
    env = {
        "RLX_RUN_ID": "chosen",
        "SKYPILOT_TASK_ID": "sky-managed-2025-01-01_gsm8k_3",
        "DSTACK_RUN_NAME": "gsm8k-run",
        "SLURM_JOB_ID": "4242",
    }
    assert resolve_run_id("gsm8k-grpo", env) == "chosen"
    del env["RLX_RUN_ID"]
    assert resolve_run_id("gsm8k-grpo", env) == "sky-managed-2025-01-01_gsm8k_3"
    del env["SKYPILOT_TASK_ID"]
    assert resolve_run_id("gsm8k-grpo", env) == "gsm8k-run"
    del env["DSTACK_RUN_NAME"]
    # A resubmitted Slurm job gets a new SLURM_JOB_ID, so it must not name the run.
    assert resolve_run_id("gsm8k-grpo", env) == "gsm8k-grpo"
    assert resolve_run_id("gsm8k-grpo", {"RLX_RUN_ID": "", "SKYPILOT_TASK_ID": " "}) == (
        "gsm8k-grpo"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("sky-2025/01 my task:1", "sky-2025-01-my-task-1"),
        ("../../etc", "etc"),
        ("..", ""),
        ("a" * 300, "a" * 128),
    ],
)
def test_run_ids_are_safe_folder_names(raw: str, expected: str) -> None:
    assert sanitize_run_id(raw) == expected


def test_a_run_id_must_come_from_somewhere() -> None:
    with pytest.raises(RlxError, match="RLX_RUN_ID"):
        resolve_run_id("///", {})
    with pytest.raises(ValueError, match="safe folder name"):
        CheckpointManager(Path("/tmp"), "../x", keep=1)


def test_resolve_resume(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=3)
    assert resolve_resume("auto", manager) is None
    assert resolve_resume("never", manager) is None
    manager.save(1, {"meta": {}})
    newest = manager.save(2, {"meta": {}})
    assert resolve_resume("auto", manager) == newest
    with pytest.raises(RlxError, match=r"resume: never.*step-000002.*RLX_RUN_ID"):
        resolve_resume("never", manager)
    older = tmp_path / "run" / "step-000001"
    assert resolve_resume(str(older), manager) == older
    with pytest.raises(RlxError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope"), manager)
    with pytest.raises(RlxError, match="not a folder"):
        resolve_resume(str(newest / MARKER), manager)
    with pytest.raises(RlxError, match=r"run folder; did you mean .*step-000002"):
        resolve_resume(str(tmp_path / "run"), manager)


# --------------------------------------------------------------------------- sharded (DCP)
# Training workers as in a run (the same class Ray places), in processes of their own with
# a real gloo group: a save at 2 ranks is read back at 3 ranks and exported.


def test_a_truncated_newest_step_resumes_from_the_newest_that_verifies(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=3)
    older = manager.save(1, {"weights": {"w": torch.ones(64)}})
    newest = manager.save(2, {"weights": {"w": torch.ones(64)}})
    shard = newest / "weights.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])  # a shard cut short: sizes tell, no reading
    notes: list[str] = []
    assert resolve_resume("auto", manager, notes.append) == older
    assert len(notes) == 1
    assert "step-000002" in notes[0] and "weights.safetensors has 100 of its" in notes[0]
    assert "resuming from step-000001" in notes[0]
    # A pinned step is not swapped for another: one line, naming it.
    with pytest.raises(RlxError, match=r"resume: .*step-000002 fails verification .*pin"):
        resolve_resume(str(newest), manager)
    (older / "weights.safetensors").unlink()
    with pytest.raises(RlxError, match=r"no older checkpoint .* verifies; set RLX_RUN_ID"):
        resolve_resume("auto", manager)


def test_a_failed_save_is_abandoned_without_a_trace(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=2)
    kept = manager.save(1, {"meta": {"a": 1}})
    folder = manager.begin(2)
    manager.write_parts(folder, {"meta": {"a": 2}})
    manager.abandon(2, folder)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000001"]
    assert manager.latest() == kept and manager.problem(kept) is None
