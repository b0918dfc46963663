"""Checkpoints across processes: a save killed (SIGKILL) at every phase leaves the previous
checkpoint loadable and is never taken for complete; a sharded save at two ranks resumes at
three (DDP and FSDP2) and exports; `rlx export` refuses what it cannot export in one line."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from rlx.errors import RlxError
from rlx.trainer.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    read_marker,
    resolve_resume,
)
from rlx.trainer.rollout.base import SamplingArgs
from tests.conftest import REPO
from tests.support.processes import spawn_ranks

CRASHING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from rlx.trainer.checkpoint import CheckpointManager

    root, target, keep = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

    def die_at(phase):
        if phase == target:
            os.kill(os.getpid(), signal.SIGKILL)

    parts = {
        "policy": {"w": torch.full((64, 64), 2.0)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": []},
        "trainer_state": {"generation": 2},
    }
    CheckpointManager(root, "run", keep=keep).save(2, parts, _after_phase=die_at)
    print("survived")
    """
)


def first_parts() -> dict[str, Any]:
    return {
        "policy": {"w": torch.full((64, 64), 1.0)},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []},
        "trainer_state": {"generation": 1},
    }


@pytest.mark.parametrize(
    ("phase", "survivor_step"),
    [
        ("part:policy", 1),  # between files
        ("part:optimizer", 1),
        ("part:trainer_state", 1),
        ("written", 1),  # before the rename
        ("renamed", 1),  # renamed into place, before the marker
        ("marked", 2),  # marker durable, before rotation
        ("rotated", 2),
    ],
)
@pytest.mark.parametrize("keep", [1, 2])
def test_save_killed_at_any_phase_leaves_a_resumable_checkpoint(
    tmp_path: Path, phase: str, survivor_step: int, keep: int
) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=keep)
    manager.save(1, first_parts())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path), phase, str(keep)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -9, result.stderr
    assert "survived" not in result.stdout

    latest = manager.latest()
    assert latest is not None and latest.name == f"step-{survivor_step:06d}"
    state = manager.load(latest)
    assert state["step"] == survivor_step
    assert state["trainer_state"] == {"generation": survivor_step}
    assert torch.equal(state["policy"]["w"], torch.full((64, 64), float(survivor_step)))

    # The next save clears what the killed one left behind.
    manager.save(3, first_parts())
    leftovers = [p.name for p in manager.run_dir.iterdir() if read_marker(p) is None]
    assert leftovers == []
    assert manager.latest() == manager.run_dir / "step-000003"
    assert len(manager.checkpoints()) == keep


def test_a_killed_save_is_never_taken_for_complete(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path), "renamed", "2"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == -9
    assert (tmp_path / "run" / "step-000002").is_dir()  # in place but without its marker
    assert manager.latest() is None
    with pytest.raises(RlxError, match="no valid COMPLETE marker"):
        resolve_resume(str(tmp_path / "run" / "step-000002"), manager)


# fsdp-lora: FSDP with rank-4 adapters on the policy and (sharing its model settings) the
# critic, the frozen base sharded too.
STRATEGIES = ("ddp", "fsdp", "fsdp-lora")


def _worker_settings(tmp: Path, strategy: str) -> Any:
    from tests.support.recipes import make_recipe

    model: dict[str, Any] = {"path": "tiny:qwen2-h64-l2", "dtype": "float32"}
    if strategy.endswith("-lora"):
        model["lora"] = {"rank": 4}
    recipe = make_recipe(
        tmp,
        algorithm="ppo",
        model=model,
        rollout={"n": 4, "max_new_tokens": 12},
        batch={"prompts_per_step": 3, "micro_batch_size": 2},
        optim={"critic_lr": 2.0e-3},
        parallel={"strategy": strategy.removesuffix("-lora")},
    )
    return recipe.trainer


def _start_worker(rank: int, world: int, port: int, tmp: Path, model: str, strategy: str) -> Any:
    from rlx.trainer.actors.workers import TrainWorker, WorkerSpec
    from rlx.trainer.job import engine_dtype_name

    settings = _worker_settings(tmp, strategy)
    dtype = engine_dtype_name(settings, on_gpus=False)
    spec = WorkerSpec(settings, model, model, rank, world, world, 1, "hf", dtype, False, False)
    worker = TrainWorker(spec)
    worker.setup("127.0.0.1", port)
    return worker


def _update_share(worker: Any, batch: Any, step: int) -> Any:
    rank, world = worker.spec.rank, worker.spec.world_size
    share = len(batch) // world
    rows = range(rank * share, (rank + 1) * share)
    return worker.update(batch.select(rows), step, True, None).stats


def _full_state(worker: Any) -> dict[str, Any]:
    """Every tensor of the policy, critic and both optimisers, whole, on the CPU (collective
    under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    learner = worker.learner
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    policy, optimizer = get_state_dict(learner.policy, learner.optimizer, options=options)
    critic, critic_optimizer = get_state_dict(
        learner.critic, learner.critic_optimizer, options=options
    )
    # Copies: on the CPU these are the live parameters, which the next update moves.
    policy, critic, optimizer, critic_optimizer = copy.deepcopy(
        (policy, critic, optimizer, critic_optimizer)
    )
    return {
        "policy": policy,
        "optimizer": optimizer.get("state", {}),  # rank 0 alone gets them whole
        "critic": critic,
        "critic_optimizer": critic_optimizer.get("state", {}),
    }


def _save_at(rank: int, world: int, port: int, tmp: str, model: str, strategy: str) -> None:
    """One update at `world` ranks, then the run's save: every rank its shard, rank 0 the
    rest; rank 0 keeps the whole state and the policy's logits as the reference."""
    import torch.distributed as dist

    from rlx.trainer.checkpoint.protocol import SaveRequest
    from rlx.trainer.checkpoint.training import CONTROLLER_RNG, TRAINER_STATE

    torch.set_num_threads(1)
    folder = Path(tmp)
    worker = _start_worker(rank, world, port, folder, model, strategy)
    batch = torch.load(folder / "batch.pt", weights_only=False)
    _update_share(worker, batch, 1)
    rng_states: list[Any] = [None] * world
    dist.all_gather_object(rng_states, worker.rng_state())
    manager = CheckpointManager(folder / "ckpt", "run", 2)
    temporary = [str(manager.begin(1)) if rank == 0 else ""]
    dist.broadcast_object_list(temporary)
    controller = {
        TRAINER_STATE: {"step": 1, "world_size": world, "algorithm": "ppo"},
        CONTROLLER_RNG: capture_rng_state(),
    }
    saved = worker.save_checkpoint(SaveRequest(temporary[0], manager, 1, controller, rng_states))
    full = _full_state(worker)
    with torch.no_grad():
        logits = worker.learner.policy(batch.input_ids).logits  # (B, T, V)
    if rank == 0:
        torch.save({"saved": saved, "state": full, "logits": logits}, folder / "reference.pt")
    worker.close()


def _resume_at(rank: int, world: int, port: int, tmp: str, model: str, strategy: str) -> None:
    """Load the checkpoint at `world` ranks; rank 0 keeps the whole state as loaded, every
    rank's load report, and the numbers of one more update."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    folder = Path(tmp)
    worker = _start_worker(rank, world, port, folder, model, strategy)
    path = torch.load(folder / "reference.pt", weights_only=False)["saved"].path
    report = worker.load_checkpoint(CheckpointManager(folder / "ckpt", "run", 2), path)
    full = _full_state(worker)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    batch = torch.load(folder / "batch.pt", weights_only=False)
    stats = _update_share(worker, batch, 2)
    if rank == 0:
        torch.save({"state": full, "reports": reports, "stats": stats}, folder / "resumed.pt")
    worker.close()


@pytest.fixture(scope="module")
def ppo_batch(tiny_model_dir: Path) -> Any:
    """12 samples (3 prompts x 4) with advantages and returns: splits over 2 and 3 ranks."""
    from rlx.trainer.batch import ADVANTAGES, RETURNS, pack_rollout
    from rlx.trainer.rollout.hf import HFEngine

    engine = HFEngine(tiny_model_dir)
    prompts = [[256, 72, 105], [256, 65, 66, 67, 68], [256, 49]]
    batch = pack_rollout(
        engine.generate(prompts, SamplingArgs(4, max_new_tokens=12, min_new_tokens=3), seed=0)
    )
    generator = torch.Generator().manual_seed(0)
    mask = batch.response_mask
    advantages = torch.where(mask, torch.randn(mask.shape, generator=generator), 0.0)
    return batch.with_fields(**{ADVANTAGES: advantages, RETURNS: torch.where(mask, 0.5, 0.0)})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_save_at_two_ranks_resumes_at_three_and_exports(
    tmp_path: Path, tiny_model_dir: Path, ppo_batch: Any, strategy: str
) -> None:
    from transformers import AutoModelForCausalLM

    from rlx.trainer.checkpoint.export import export_checkpoint

    torch.save(ppo_batch, tmp_path / "batch.pt")
    model = str(tiny_model_dir)
    spawn_ranks(_save_at, 2, str(tmp_path), model, strategy)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    saved = Path(reference["saved"].path)
    assert read_marker(saved) is not None and reference["saved"].bytes > 0
    shards = sorted(p.name for p in (saved / "learner").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own file

    spawn_ranks(_resume_at, 3, str(tmp_path), model, strategy)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    want, got = reference["state"], resumed["state"]
    for part in ("policy", "critic"):
        assert got[part].keys() == want[part].keys()
        for name, tensor in want[part].items():
            assert torch.equal(got[part][name], tensor), (part, name)
    for part in ("optimizer", "critic_optimizer"):
        assert got[part].keys() == want[part].keys()
        for name, state in want[part].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(got[part][name][key]), torch.as_tensor(value))
    assert [r.rng_restored for r in resumed["reports"]] == [False] * 3  # 2 states for 3 ranks
    learner_bytes = sum(p.stat().st_size for p in (saved / "learner").iterdir())
    for report in resumed["reports"]:
        assert 0 <= report.host_bytes < 256 * 2**20 + 4 * learner_bytes
    assert math.isfinite(resumed["stats"].same["grad_norm"]) and resumed["stats"].updates > 0

    if strategy.endswith("-lora"):
        _check_adapter_exports(saved, tmp_path, model, ppo_batch.input_ids, reference["logits"])
        return
    out = tmp_path / "exported"
    exported = export_checkpoint(saved, out)
    assert exported.dtype == "float32" and (out / "model.safetensors").is_file()
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    # Large models go to several files and an index: the same weights, split.
    split = export_checkpoint(saved, tmp_path / "split", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert split.files > 1 and len(set(index["weight_map"].values())) == split.files
    for folder in (out, tmp_path / "split"):
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf_model(ppo_batch.input_ids).logits  # (B, T, V)
        assert float((logits - reference["logits"]).abs().max()) <= 1e-5


def _check_adapter_exports(saved: Path, tmp: Path, base: str, input_ids: Any, logits: Any) -> None:
    """A LoRA checkpoint exports its adapter in PEFT's format, and with merge a whole model:
    both give the learner's logits (base + adapter) within 1e-5."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlx.trainer.checkpoint.export import export_checkpoint

    adapter = tmp / "adapter"
    export_checkpoint(saved, adapter)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapter.iterdir()
    }
    assert not (adapter / "model.safetensors").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny:qwen2-h64-l2"  # as the run named it
    merged = tmp / "merged"
    export_checkpoint(saved, merged, merge=True)
    models = {
        "adapter": PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
        ).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval(),
    }
    for kind, model in models.items():
        with torch.no_grad():
            got = model(input_ids).logits
        assert float((got - logits).abs().max()) <= 1e-5, kind


def rlx_export(*args: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLX_")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "rlx", "export", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_export_refuses_what_it_cannot_export_in_one_line(tmp_path: Path) -> None:
    old = CheckpointManager(tmp_path / "ckpt", "old", 1)
    old_format = old.save(1, {"policy": {"w": torch.zeros(2)}})  # a single-file checkpoint
    (old.run_dir / "step-000002").mkdir()  # an interrupted save
    (tmp_path / "plain").mkdir()
    (tmp_path / "file.txt").write_text("x")
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "file.txt": "is not a folder",
        tmp_path / "plain": "is not a checkpoint",
        old.run_dir / "step-000002": "interrupted save",
        old.run_dir: f"did you mean {old_format}",
        old_format: "written by an older rlx",
    }
    for source, message in cases.items():
        result = rlx_export(source, tmp_path / "out")
        assert result.returncode == 1, (source, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
        assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
