"""Both checkpoint managers follow protocol.Checkpoints, member for member and parameter for
parameter: the controller and the training ranks call whichever one they are handed."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest

from rlx.trainer.checkpoint import Checkpoints, open_manager
from rlx.trainer.checkpoint.remote import StoreCheckpointManager
from rlx.trainer.checkpoint.store import CheckpointManager

MEMBERS = {
    name: value
    for name, value in vars(Checkpoints).items()
    if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
}


def test_the_protocol_names_what_a_save_and_a_load_need() -> None:
    assert {"rank_folder", "save_shard", "commit_save", "discard", "load_parts"} <= set(MEMBERS)
    assert set(Checkpoints.__annotations__) == {"run_id", "keep", "background"}


@pytest.mark.parametrize("manager", [CheckpointManager, StoreCheckpointManager])
def test_each_manager_has_every_member_with_its_parameters(manager: type) -> None:
    for name, member in MEMBERS.items():
        own = inspect.getattr_static(manager, name)
        if isinstance(member, property):
            assert isinstance(own, property), name
            continue
        wanted = list(inspect.signature(member).parameters)
        assert list(inspect.signature(own).parameters) == wanted, name
    assert isinstance(manager.background, bool)


def test_a_store_manager_saves_in_the_background_and_a_folder_does_not(tmp_path: Path) -> None:
    assert open_manager(tmp_path, "run", 1).background is False
    assert StoreCheckpointManager.background is True


def test_a_store_manager_travels_as_what_opens_it() -> None:
    pytest.importorskip("s3fs")
    manager = open_manager("s3://bucket/ckpt/", "run", 2)
    copy = pickle.loads(pickle.dumps(manager))
    assert isinstance(copy, StoreCheckpointManager)
    assert (copy.root, copy.run_id, copy.keep) == ("s3://bucket/ckpt", "run", 2)
    # Its filesystem stays behind: each rank opens the store with what its own node has.
    assert b"s3fs" not in pickle.dumps(manager)
