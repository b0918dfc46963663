"""rlx stays light: `rlx --help`, `rlx render` and `rlx plan` import none of the heavy
libraries (each checked in a fresh interpreter, whose imports are its own)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import RECIPES

HEAVY = ("torch", "ray", "sky", "dstack", "vllm", "transformers", "tokenizers", "numpy")


PROBE = """
import sys
from rlx.cli import app
try:
    app(args=sys.argv[1:], prog_name="rlx")
except SystemExit:
    pass
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


def heavy_imports(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,), *args], capture_output=True, text=True, timeout=120
    )
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")][-1]
    return [m for m in line.removeprefix("HEAVY=").split(",") if m]


def test_help_imports_no_heavy_library():
    assert heavy_imports("--help") == []


def test_render_imports_no_heavy_library():
    assert heavy_imports("render", str(RECIPES / "gsm8k-grpo.yaml"), "-b", "sky") == []
    assert heavy_imports("lint", str(RECIPES)) == []


def test_plan_needs_no_heavy_library() -> None:
    assert heavy_imports("plan", str(RECIPES / "ppo-7b.yaml")) == []
