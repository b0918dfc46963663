"""rlx ships itself: the wheel of this rlx, and the check a node makes of the rlx it runs
(the wheel installed on emulated hosts: tests/hosts/test_ship.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.launchers.ship import build_wheel, shipped_version
from rlx.node.version import check_node_version


def test_the_wheel_is_this_rlx_and_installs(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    assert wheel.name == f"rlx-{shipped_version()}-py3-none-any.whl"
    assert build_wheel(tmp_path) == wheel  # reused, not rebuilt
    names = zipfile.ZipFile(wheel).namelist()
    assert "rlx/cli.py" in names and "rlx/launchers/ship.py" in names
    assert not any("__pycache__" in n for n in names)
    with pytest.raises(RlxError, match=r"this node runs rlx .*launched with rlx 9\.9"):
        check_node_version({"RLX_WHEEL": "/x/rlx-9.9+gabc-py3-none-any.whl"})
    check_node_version({})
