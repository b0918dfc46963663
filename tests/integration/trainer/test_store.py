"""Checkpoints and run folders in object storage, against real stores started here: S3
(moto's server), GCS (gcp-storage-emulator) and Azure Blob (Azurite).

The manager: a step is complete only once its COMPLETE marker is written, last; a prefix
without one is never loaded and is cleaned up by the next save; retention deletes old
complete steps only, marker first. The trainer: `rlx train` at 2 training ranks (FSDP, a
Ray cluster of two nodes here) writes its shards to S3, a worker killed inside a save
resumes from the previous complete step, SIGTERM saves the step done and exits 75, and the
resumed runs log the same rewards as a straight run. GCS and Azure: the same store calls
(a shard's upload and receipt, metadata late, the marker last, a save cut short, a resume
reading in place) in one process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlx.errors import RlxError
from tests.support.cli import run_rlx
from tests.support.fixtures import ray_nodes_here
from tests.support.recipes import write_recipe
from tests.support.stores import StoreServer, azure_server, gcs_server, s3_server

pytest.importorskip("ray")
pytest.importorskip("s3fs")
pytestmark = pytest.mark.timeout(1200)

SAMPLED = ("reward/mean", "reward/std", "response_length/mean")  # equal exactly
COMPUTED = ("approx_kl", "clipfrac", "entropy", "grad_norm", "loss/policy", "lr")
RELATIVE = 1e-6


@pytest.fixture(scope="module")
def stores() -> Iterator[dict[str, StoreServer]]:
    """The three stores, up for the module: the Ray cluster below starts with their
    environment, as a cloud node has its store's settings in its own."""
    with s3_server() as s3, gcs_server() as gcs, azure_server() as azure:
        yield {"s3": s3, "gcs": gcs, "azure": azure}


@pytest.fixture(scope="module")
def s3(stores: dict[str, StoreServer]) -> StoreServer:
    return stores["s3"]


@pytest.fixture
def store_env(s3: StoreServer, monkeypatch: pytest.MonkeyPatch) -> StoreServer:
    """This process as a client of the S3 server (rlx reads the endpoint from env)."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3


# --------------------------------------------------------------------------- the manager


def _save(manager: Any, step: int, value: float, hook: Any = None) -> str:
    staging = manager.begin(step)
    try:
        entries = manager.write_parts(staging, {"trainer_state": {"step": step, "v": value}})
        return manager.commit(staging, step, entries, [], _after_phase=hook)
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def test_only_marked_steps_count_and_retention_deletes_marker_first(store_env) -> None:
    from rlx.trainer.checkpoint import MARKER, open_manager

    root = store_env.new_prefix()
    manager = open_manager(root, "run-a", keep=2)
    fs = manager.fs
    first = _save(manager, 1, 0.5)
    assert manager.latest() == first == f"{root}/run-a/step-000001"
    # A save killed before its marker: files without COMPLETE are not a checkpoint.
    with pytest.raises(RuntimeError):
        _save(manager, 2, 0.7, hook=lambda phase: _die(phase, "written"))
    partial = fs._strip_protocol(f"{root}/run-a/step-000002")
    assert fs.exists(f"{partial}/trainer_state.json")
    assert not fs.exists(f"{partial}/{MARKER}")
    assert manager.latest() == first
    # The next save clears it, and keeps two complete steps.
    _save(manager, 3, 0.9)
    _save(manager, 4, 1.1)
    fs.invalidate_cache()
    assert not fs.exists(partial)
    assert [u.rsplit("/", 1)[-1] for u in manager.checkpoints()] == ["step-000003", "step-000004"]
    assert manager.load_parts(manager.latest(), ["trainer_state"])["trainer_state"] == {
        "step": 4,
        "v": 1.1,
    }


def test_a_damaged_file_is_reported_not_loaded(store_env) -> None:
    from rlx.trainer.checkpoint import open_manager

    manager = open_manager(store_env.new_prefix(), "run-b", keep=1)
    url = _save(manager, 5, 0.25)
    target = manager.fs._strip_protocol(f"{url}/trainer_state.json")
    text = manager.fs.cat_file(target)
    manager.fs.pipe(target, text.replace(b"0.25", b"0.75"))  # same size, other bytes
    with pytest.raises(RlxError, match="does not match its checksum"):
        manager.load_parts(url, ["trainer_state"])


def test_an_upload_missing_from_the_listing_leaves_no_marker(store_env) -> None:
    from rlx.trainer.checkpoint import open_manager

    manager = open_manager(store_env.new_prefix(), "run-c", keep=1)
    staging = manager.begin(1)
    entries = manager.write_parts(staging, {"trainer_state": {"step": 1}})
    ghost = [{"name": "learner/__1_0.distcp", "bytes": 123}]  # a rank that never uploaded
    with pytest.raises(RlxError, match="is not in the store"):
        manager.commit(staging, 1, entries, ghost)
    assert manager.latest() is None


def test_rank_zero_commits_only_once_every_rank_reported_its_upload(store_env, tmp_path) -> None:
    """The store is the rendezvous of an upload off the step's path: rank 0 goes on only
    when every rank's receipt is in, gets their files from the receipts, and the marker it
    writes lists them; the receipts are gone once the step is complete."""
    import threading

    from rlx.trainer.checkpoint import open_manager
    from rlx.trainer.checkpoint.remote import RECEIPTS, read_marker_url

    manager = open_manager(store_env.new_prefix(), "run-d", keep=1)
    staging = manager.begin(1)
    entries = manager.write_parts(staging, {"trainer_state": {"step": 1}})
    shards = {}
    for rank in range(3):
        shard = tmp_path / f"rank-{rank}" / "learner"
        shard.mkdir(parents=True)
        (shard / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (1000 + rank))
        shards[rank] = manager.upload(shard, 1, "learner")
    for rank in (0, 1):
        manager.report_upload(1, rank, shards[rank])
    with pytest.raises(RlxError, match="1 of 3 ranks did not finish their upload"):
        manager.wait_for_uploads(1, 3, timeout=0.3)

    got: list[list[dict]] = []
    waiting = threading.Thread(target=lambda: got.append(manager.wait_for_uploads(1, 3)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not got  # still two of three
    manager.report_upload(1, 2, shards[2])
    waiting.join(30)
    assert sorted(f["name"] for f in got[0]) == [f"learner/__{r}_0.distcp" for r in range(3)]

    url = manager.commit(staging, 1, entries, got[0])
    marker = read_marker_url(url)
    listed = {f["name"]: f["bytes"] for f in marker["files"]}
    assert all(listed[f"learner/__{r}_0.distcp"] == 1000 + r for r in range(3)), listed
    path = manager.fs._strip_protocol(url)
    manager.fs.invalidate_cache()
    assert not manager.fs.exists(f"{path}/{RECEIPTS}")


def _die(phase: str, at: str) -> None:
    if phase == at:
        raise RuntimeError(f"killed after {phase}")


# --------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def ray_nodes(stores: dict[str, StoreServer]) -> Iterator[Any]:
    """Two Ray nodes here whose workers have the stores' settings in their environment."""
    env = {key: value for store in stores.values() for key, value in store.env.items()}
    with ray_nodes_here(2, env) as cluster:
        yield cluster


def store_recipe(workdir: Path, name: str, root: str, **overrides: Any) -> Path:
    """GRPO on the tiny model at 2 FSDP ranks, 4 steps, a checkpoint every 2 and the run
    folder in the store too."""
    settings: dict[str, Any] = {
        "rollout": {"n": 4, "max_new_tokens": 16},
        "batch": {"prompts_per_step": 4, "micro_batch_size": 8},
        "parallel": {"strategy": "fsdp"},
        "steps": 4,
        "checkpoint": {"dir": f"{root}/ckpt", "every": 2, "keep": 2},
        "logging": {"dir": f"{root}/runs", "tensorboard": False},
    }
    for key, value in overrides.items():
        settings[key] = {**settings[key], **value} if isinstance(value, dict) else value
    path = write_recipe(workdir, name, **settings)
    data = yaml.safe_load(path.read_text())
    data["resources"] = {"nodes": 2}
    path.write_text(yaml.safe_dump(data))
    return path


def train(recipe: Path, run_id: str, cluster: Any, store: StoreServer, **env: str):
    return run_rlx(
        ["train", str(recipe)],
        recipe.parent,
        RLX_RUN_ID=run_id,
        RAY_ADDRESS=cluster.address,
        RLX_NUM_THREADS="1",
        RLX_STAGING_DIR=str(recipe.parent / f"staging-{run_id}"),
        **store.env,
        **env,
    )


def store_metrics(store: StoreServer, root: str, run_id: str) -> list[dict[str, Any]]:
    fs = store.filesystem()
    text = fs.cat_file(fs._strip_protocol(f"{root}/runs/{run_id}/metrics.jsonl")).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def straight_root(s3: StoreServer) -> str:
    return s3.new_prefix()


@pytest.fixture(scope="module")
def straight(
    workdir: Path, ray_nodes: Any, s3: StoreServer, straight_root: str
) -> list[dict[str, Any]]:
    root = straight_root
    recipe = store_recipe(workdir, "straight", root)
    result = train(recipe, "straight", ray_nodes, s3)
    assert result.returncode == 0, result.stderr[-3000:]
    fs = s3.filesystem()
    learner = fs._strip_protocol(f"{root}/ckpt/straight/step-000004/learner")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(learner)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # The run folder went to the store: metrics, result, the exported model.
    assert json.loads(fs.cat_file(fs._strip_protocol(f"{root}/runs/straight/result.json")))[
        "state"
    ] == ("SUCCEEDED")
    assert fs.exists(fs._strip_protocol(f"{root}/runs/straight/model/model.safetensors"))
    assert not any((workdir / "staging-straight").rglob("*.distcp"))  # staging cleaned up
    return store_metrics(s3, root, "straight")


def close(got: float | None, want: float | None) -> bool:
    if got is None or want is None:
        return got is want
    return math.isclose(got, want, rel_tol=RELATIVE, abs_tol=1e-12)


def assert_same_run(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for expected, actual in zip(want, got, strict=True):
        for key in SAMPLED:
            assert actual.get(key) == expected.get(key), (actual["step"], key)
        for key in COMPUTED:
            assert close(actual.get(key), expected.get(key)), (actual["step"], key)


def test_s3_sigterm_saves_then_a_kill_inside_a_save_resumes_from_the_last_complete_step(
    workdir, ray_nodes, s3, straight
) -> None:
    """A preemption (SIGTERM after step 1: it saves step 1 and exits 75), then a worker
    killed inside the save of step 4: the second resume loads step 2, and the three
    attempts together log what the straight run did, no step lost or trained twice."""
    root = s3.new_prefix()
    recipe = store_recipe(workdir, "preempted", root)
    stopped = train(recipe, "preempted", ray_nodes, s3, RLX_TEST_KILL_AT="term:1")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert f"checkpoint {root}/ckpt/preempted/step-000001" in stopped.stdout
    line = next(x for x in stopped.stdout.splitlines() if x.startswith("stopping on SIGTERM"))
    seconds = float(line.split(", ")[1].split(" s after")[0])
    assert seconds < 30, line  # within GCP's grace, on two CPU ranks
    crashed = train(recipe, "preempted", ray_nodes, s3, RLX_TEST_KILL_AT="save:4:written")
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert "(step 1)" in crashed.stdout and "Traceback" not in crashed.stderr
    fs = s3.filesystem()
    step4 = fs._strip_protocol(f"{root}/ckpt/preempted/step-000004")
    assert fs.exists(f"{step4}/learner/.metadata") and not fs.exists(f"{step4}/COMPLETE")
    resumed = train(recipe, "preempted", ray_nodes, s3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root}/ckpt/preempted/step-000002 (step 2)" in resumed.stdout
    assert_same_run(store_metrics(s3, root, "preempted"), straight)
    fs.invalidate_cache()
    assert not fs.exists(step4 + "/learner/.metadata") or fs.exists(f"{step4}/COMPLETE")


@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_gcs_and_azure_keep_the_save_and_resume_protocol(
    kind, stores, tmp_path, monkeypatch
) -> None:
    """What a rank's save and a resume do to the store, on GCS and Azure (the trainer's
    whole path runs on S3 above; the store calls are the same): a DCP shard staged and
    uploaded with its receipt, the metadata late, COMPLETE last; a save cut short once every
    file is in (before its marker) is never loaded and the next save deletes it; DCP reads
    the newest complete step in place (byte ranges through fsspec)."""
    from rlx.trainer.checkpoint import MARKER, open_manager
    from rlx.trainer.checkpoint.remote import DCP_METADATA, remove
    from rlx.trainer.checkpoint.training import load_learner_state, save_learner_state

    store = stores[kind]
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RLX_STAGING_DIR", str(tmp_path / "staging"))
    manager = open_manager(f"{store.new_prefix()}/ckpt", "run", keep=2)

    def state(value: float) -> dict[str, torch.Tensor]:
        return {"w": torch.full((256, 256), value), "b": torch.arange(5000.0) * value}

    def save(step: int, hook: Any = None) -> str:
        staging = manager.begin(step)
        try:
            save_learner_state(state(float(step)), staging / "learner")
            mine = manager.upload(staging / "learner", step, "learner", skip=(DCP_METADATA,))
            manager.report_upload(step, 0, mine)
            entries = manager.write_parts(staging, {"trainer_state": {"step": step}})
            entries["learner"] = {"file": "learner", "format": "dcp"}
            return manager.commit(
                staging,
                step,
                entries,
                manager.wait_for_uploads(step, 1),
                late=(f"learner/{DCP_METADATA}",),
                _after_phase=hook,
            )
        finally:
            remove(staging)

    first = save(1)
    with pytest.raises(RuntimeError):
        save(2, hook=lambda phase: _die(phase, "written"))
    fs = manager.fs
    partial = fs._strip_protocol(manager.step_url(2))
    assert fs.exists(f"{partial}/learner/{DCP_METADATA}") and not fs.exists(f"{partial}/{MARKER}")
    assert manager.latest() == first

    parts = manager.load_parts(first, ["learner", "trainer_state"])
    assert parts["trainer_state"] == {"step": 1} and parts["learner"] == f"{first}/learner"
    loaded = state(0.0)
    load_learner_state(loaded, parts["learner"], manager.shard_reader(parts["learner"]))
    assert all(torch.equal(loaded[k], v) for k, v in state(1.0).items())

    third = save(3)
    fs.invalidate_cache()
    assert not fs.exists(partial)
    assert manager.checkpoints() == [first, third]


def test_export_reads_a_checkpoint_from_the_store(workdir, s3, straight, straight_root) -> None:
    out = workdir / "exported"
    checkpoint = f"{straight_root}/ckpt/straight/step-000004"
    result = run_rlx(["export", checkpoint, str(out)], workdir, **s3.env)
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())


def test_status_finds_the_newest_checkpoint_in_the_store(store_env, straight, straight_root):
    from rlx.checkpoints import newest_complete_step

    run = f"{straight_root}/ckpt/straight"
    assert newest_complete_step(run) == f"{run}/step-000004"


def test_the_run_folder_goes_to_the_store_and_comes_back(store_env, tmp_path) -> None:
    """logging.dir in a store: a push sends what is new or changed; a later attempt on
    another machine fetches it before it continues the same files."""
    from rlx.runs import RunPaths, pull_run, push_run

    url = f"{store_env.new_prefix()}/runs/r"
    here = tmp_path / "here" / "r"
    (here / "tensorboard").mkdir(parents=True)
    (here / "metrics.jsonl").write_text('{"step": 1}\n')
    (here / "tensorboard" / "events").write_bytes(b"\0" * 10)
    push_run(RunPaths("r", here, None, url))
    with (here / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2}\n')
    push_run(RunPaths("r", here, None, url))
    there = tmp_path / "there" / "r"
    assert pull_run(RunPaths("r", there, None, url)) == 2
    assert (there / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (there / "tensorboard" / "events").read_bytes() == b"\0" * 10
