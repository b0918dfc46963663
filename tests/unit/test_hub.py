"""Hub ids resolved to snapshots in a hub cache the test fills (HF_HUB_OFFLINE=1): on the
head at the main revision, on a node at the commit the head resolved, once per node however
many ranks ask; and every way it goes wrong as one line naming the field and the id."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from rlx import hub
from rlx.errors import RlxError
from rlx.plan.shapes import find_shape
from rlx.trainer.resolve import node_model_path, resolve_model_path
from tests.support.cli import assert_one_line_error, invoke
from tests.support.hub import HUB_ID, fill_hub_cache
from tests.support.recipes import write_recipe


@pytest.fixture
def served(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    cache = fill_hub_cache(tmp_path / "hub", tiny_model_dir)
    for name, value in cache.env.items():
        monkeypatch.setenv(name, value)
    return cache


def test_a_hub_id_resolves_to_its_snapshot_on_the_head_and_on_a_node(served, tmp_path: Path):
    head = resolve_model_path(HUB_ID, tmp_path / "models", seed=0)
    assert Path(head) == served.snapshot and hub.is_complete(Path(head))
    assert hub.commit_of(head) == served.snapshot.name
    # A node resolves the head's commit, not whatever main says by then.
    newer = tmp_path / "newer"
    shutil.copytree(served.snapshot, newer)
    (newer / "config.json").write_text(
        json.dumps({**json.loads((newer / "config.json").read_text()), "rlx_newer": True})
    )
    later = hub.put_in_cache(newer, HUB_ID)
    assert later != served.snapshot and hub.cached_file(HUB_ID, "config.json") is not None
    assert node_model_path(head, HUB_ID, seed=0) == head
    # The planner reads the main revision's config from the cache, without a network.
    assert find_shape(HUB_ID).source == str(later / "config.json")


def test_a_node_fetches_once_however_many_ranks_ask(served, monkeypatch: pytest.MonkeyPatch):
    commit = served.snapshot.name
    weights = served.snapshot / "model.safetensors"
    kept = weights.read_bytes()
    weights.unlink()  # this node's copy is incomplete: the first rank fetches it
    fetches = []
    real = hub._download

    def fetch(*args, **kwargs):
        fetches.append(threading.get_ident())
        time.sleep(0.2)  # the other ranks arrive while it runs
        weights.write_bytes(kept)
        return real(*args, **kwargs)

    monkeypatch.setattr(hub, "_download", fetch)
    found: list[Path] = []
    ranks = [
        threading.Thread(target=lambda: found.append(hub.snapshot(HUB_ID, revision=commit)))
        for _ in range(4)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert found == [served.snapshot] * 4 and len(fetches) == 1


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        (
            "acme/no-such-model",
            ["acme/no-such-model is not in the Hugging Face cache", "HF_HUB_OFFLINE=1"],
        ),
        ("not a hub id!", ["is not a hub id (org/name) nor a local folder"]),
    ],
)
def test_a_missing_or_malformed_id_is_one_line(served, tmp_path: Path, spec, needles) -> None:
    with pytest.raises(RlxError) as raised:
        resolve_model_path(spec, tmp_path, seed=0, field="critic_model")
    message = str(raised.value)
    assert message.startswith(f"trainer.critic_model.path: {spec}") and "\n" not in message
    assert all(needle in message for needle in needles), message


def test_a_snapshot_without_safetensors_or_incomplete_is_refused(served, tmp_path: Path) -> None:
    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text("{}")
    (only_bin / "pytorch_model.bin").write_bytes(b"0")
    hub.put_in_cache(only_bin, "acme/bin-only")
    with pytest.raises(RlxError, match="acme/bin-only has no safetensors weights"):
        hub.snapshot("acme/bin-only")
    (served.snapshot / "config.json").unlink()
    with pytest.raises(RlxError, match=r"is incomplete .* without HF_HUB_OFFLINE"):
        hub.snapshot(HUB_ID)


def test_train_refuses_a_missing_id_before_anything_starts(served, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, model={"path": "acme/missing-7b", "dtype": "float32"})
    result = invoke(["train", str(recipe)], env={"RLX_RUN_ID": "missing"})
    assert_one_line_error(result, "trainer.model.path: acme/missing-7b is not in the Hugging Face")
