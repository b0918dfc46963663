"""Storage faults met as a user meets them, with the real parts: moto's S3 server behind a
fault-injecting proxy on loopback (503 SlowDown for a share of requests, a reset in the middle
of an upload, a stall past the timeout), a bucket that does not exist, a read-only mount, and
a small tmpfs that fills during a save. Each fault is one line and no traceback; a full disk
leaves the previous step intact and nothing the next launch trips on."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlx.errors import TRY_AGAIN, RlxError
from tests.support.cli import assert_one_line_error, run_rlx
from tests.support.faulty import Faults, faulty_proxy
from tests.support.recipes import write_recipe
from tests.support.stores import StoreServer, free_port, s3_server

pytest.importorskip("s3fs")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture(scope="module")
def s3() -> Iterator[StoreServer]:
    with s3_server() as server:
        yield server


@pytest.fixture
def client(s3: StoreServer, monkeypatch: pytest.MonkeyPatch) -> StoreServer:
    """This process as a client of the S3 server (rlx reads the endpoint from env)."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3


@contextlib.contextmanager
def tmpfs(folder: Path, *options: str) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(folder)], check=True
    )
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def one_line(exc: pytest.ExceptionInfo[RlxError], *needles: str) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


# --------------------------------------------------------------------------- the probe


@root_only
def test_the_probe_names_each_location_it_cannot_write(client, monkeypatch, tmp_path) -> None:
    from rlx.storage import probe_writable

    with pytest.raises(RlxError) as missing:
        probe_writable("s3://no-such-bucket/runs", "trainer.checkpoint.dir")
    one_line(missing, "trainer.checkpoint.dir: s3://no-such-bucket/runs", "does not exist")
    probe_writable(client.new_prefix(), "trainer.checkpoint.dir")  # a bucket that exists
    with monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        with pytest.raises(RlxError) as nobody:
            probe_writable("s3://b/runs", "trainer.logging.dir")
        one_line(nobody, "trainer.logging.dir: s3://b/runs", "AWS_ENDPOINT_URL")
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as read_only:
        with pytest.raises(RlxError) as refused:
            probe_writable(str(read_only / "ckpt"), "trainer.checkpoint.dir")
        one_line(refused, f"{read_only / 'ckpt'}", "Read-only file system", "writable")
    assert not list((tmp_path).glob("**/.rlx-probe-*"))


def test_the_probe_waits_out_a_throttling_store(client, monkeypatch) -> None:
    from rlx.storage import probe_writable

    root = client.new_prefix()
    faults = Faults(unavailable=0.5, seed=11)
    with faulty_proxy(client.endpoint, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        for _ in range(5):  # a busy store is there: each probe gets through
            probe_writable(root, "trainer.checkpoint.dir")
    assert faults.counts["503"] > 0, faults.counts


def test_a_missing_bucket_stops_rlx_train_before_the_model_loads(s3, tmp_path) -> None:
    recipe = write_recipe(tmp_path, checkpoint={"dir": "s3://no-such-bucket/runs", "every": 1})
    started = time.monotonic()
    done = run_rlx(["train", str(recipe)], tmp_path, timeout=120, **s3.env)
    seconds = time.monotonic() - started
    assert_one_line_error(done, "trainer.checkpoint.dir: s3://no-such-bucket/runs", "create it")
    assert "weights of step" not in done.stdout  # no model was loaded
    assert seconds < 60, seconds  # a hang bound; about 4 s here


# --------------------------------------------------------------------------- retries


def _save(manager, step: int, staging_root: Path, shard_bytes: int = 3 << 20) -> object:
    folder = manager.begin(step)
    entries = manager.write_parts(folder, {"trainer_state": {"step": step}})
    shard = folder / "learner"
    shard.mkdir(parents=True)
    (shard / "__0_0.distcp").write_bytes(os.urandom(shard_bytes))
    (shard / ".metadata").write_bytes(b"m" * 100)
    try:
        manager.save_shard(folder, step, 0, "learner")
        return manager.commit_save(folder, step, entries, 1, "learner")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_throttling_and_a_reset_mid_upload_are_retried_and_counted(
    client, monkeypatch, tmp_path
) -> None:
    from rlx.trainer.checkpoint import open_manager

    root = client.new_prefix()
    monkeypatch.setenv("RLX_STAGING_DIR", str(tmp_path / "staging"))
    faults = Faults(unavailable=0.3, resets=1, seed=3)
    with faulty_proxy(client.endpoint, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        retried = 0
        for step in (1, 2, 3):
            manager = open_manager(root, "run", keep=2)  # as each save reaches the ranks
            saved = _save(manager, step, tmp_path)
            assert manager.problem(saved.path) is None  # every file listed with its size
            retried += saved.retries
    assert faults.counts["reset"] == 1 and faults.counts["503"] > 5, faults.counts
    assert 0 < retried <= faults.counts["503"] + faults.counts["reset"]
    with monkeypatch.context() as env:  # straight to the store: both kept steps verify
        env.setenv("AWS_ENDPOINT_URL", client.endpoint)
        manager = open_manager(root, "run", keep=2)
        steps = [url.rsplit("/", 1)[-1] for url in manager.checkpoints()]
        assert steps == ["step-000002", "step-000003"]
        assert all(manager.problem(url) is None for url in manager.checkpoints())


def test_a_training_run_under_throttling_and_a_reset_finishes_with_every_step_complete(
    client, tmp_path
) -> None:
    from rlx.trainer.checkpoint import open_manager

    root = client.new_prefix()
    faults = Faults(unavailable=0.3, resets=1, seed=5)
    with faulty_proxy(client.endpoint, faults) as proxy:
        # 6 steps: the metrics of step 6 hold the retries of step 2's upload, which the
        # save of step 4 waits for (the last save's come after the last metrics)
        recipe = write_recipe(tmp_path, steps=6, checkpoint={"dir": root, "every": 2})
        env = {
            **client.env,
            "AWS_ENDPOINT_URL": proxy.endpoint,
            "RLX_RUN_ID": "throttled",
            "RLX_STAGING_DIR": str(tmp_path / "staging"),
        }
        done = run_rlx(["train", str(recipe)], tmp_path, timeout=600, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert faults.counts["reset"] == 1 and faults.counts["503"] > 0, faults.counts
    lines = (tmp_path / "runs" / "throttled" / "metrics.jsonl").read_text().splitlines()
    retries = [json.loads(line)["checkpoint/retries"] for line in lines]
    assert retries == sorted(retries) and retries[-1] > 0  # counted since the run began
    manager = open_manager(root, "throttled", keep=3)  # straight to the store
    steps = manager.checkpoints()
    names = [url.rsplit("/", 1)[-1] for url in steps]
    assert names == ["step-000002", "step-000004", "step-000006"]
    assert all(manager.problem(url) is None for url in steps)  # every file, every size


def test_a_store_that_stops_answering_fails_the_save_for_good_with_75(
    client, monkeypatch, tmp_path
) -> None:
    from rlx.trainer.checkpoint import open_manager
    from rlx.trainer.checkpoint.faults import failure_line, save_failure

    root = client.new_prefix()
    monkeypatch.setenv("RLX_STAGING_DIR", str(tmp_path / "staging"))
    monkeypatch.setenv("RLX_STORE_TIMEOUT", "1")
    monkeypatch.setenv("RLX_STORE_DEADLINE", "3")
    faults = Faults()
    with faulty_proxy(client.endpoint, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        _save(open_manager(root, "run", keep=2), 1, tmp_path, shard_bytes=1000)
        faults.stall = True
        started = time.monotonic()
        with pytest.raises(Exception) as stalled:
            _save(open_manager(root, "run", keep=2), 2, tmp_path, shard_bytes=1000)
        assert time.monotonic() - started < 60  # a hang bound: the deadline is 3 s
    failure = save_failure(stalled.value, 2, f"{root}/run")
    assert failure.exit_code == TRY_AGAIN
    line = failure_line(failure, 1)
    assert line.startswith(f"step 2 could not be saved to {root}/run: ")
    assert "kept failing" in line and line.endswith("step 1 is the newest complete checkpoint")
    assert "\n" not in line


# --------------------------------------------------------------------------- a full disk


@root_only
def test_a_full_disk_during_a_save_is_one_line_and_the_next_launch_resumes(tmp_path) -> None:
    with tmpfs(tmp_path / "small", "size=5m") as small:  # room for two 2 MiB steps, not three
        recipe = write_recipe(
            tmp_path,
            steps=6,
            checkpoint={"dir": str(small / "ckpt"), "every": 2, "keep": 2},
        )
        env = {"RLX_RUN_ID": "full"}
        failed = run_rlx(["train", str(recipe)], tmp_path, timeout=600, **env)
        assert_one_line_error(
            failed,
            f"step 6 could not be saved to {small / 'ckpt' / 'full'}: No space left on device",
            "step 4 is the newest complete checkpoint",
        )
        run = small / "ckpt" / "full"
        assert sorted(p.name for p in run.iterdir()) == ["step-000002", "step-000004"]
        result = json.loads((tmp_path / "runs" / "full" / "result.json").read_text())
        assert result["state"] == "FAILED" and result["exit_code"] == 1
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        resumed = run_rlx(["train", str(recipe)], tmp_path, timeout=600, **env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"resumed from {run / 'step-000004'} (step 4)" in resumed.stdout
        assert sorted(p.name for p in run.iterdir()) == ["step-000004", "step-000006"]
