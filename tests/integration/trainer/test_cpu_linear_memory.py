"""oneDNN's caches of product shapes stay bounded in a trainer's process: layers run forward
and backward over 300 row counts (as a learner's passes differ from step to step) grow a
process by a little with the 64 entries a trainer's Ray workers set, and by about a GiB with
torch's own 1024, which a user may still set (each case in a process of its own: torch reads
one of the settings as it loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlx.trainer.actors import ONEDNN_CACHES
from rlx.trainer.model import cpu_linear

LOOP = textwrap.dedent(
    """
    import json, os
    import rlx.trainer.actors  # before torch, as a trainer's Ray workers import it
    import torch
    from rlx.trainer.model.cpu_linear import OneDNNLinear
    torch.set_num_threads(1)
    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    layers = [OneDNNLinear(256, 1024), OneDNNLinear(1024, 256)]
    def run(rows):
        x = torch.randn(rows, 256, requires_grad=True)
        layers[1](layers[0](x)).sum().backward()
    run(8)
    before = resident()
    for rows in range(500, 800):
        run(rows)
    caches = {name: os.environ.get(name) for name in rlx.trainer.actors.ONEDNN_CACHES}
    print(json.dumps({"grown_mib": (resident() - before) / 2**20, "caches": caches}))
    """
)


def grown(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHES}
    run = subprocess.run(
        [sys.executable, "-c", LOOP],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_linear._product() is None, reason="this torch has no oneDNN linear")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_shape_caches_stay_bounded_over_many_row_counts() -> None:
    bounded = grown({})
    assert bounded["caches"] == ONEDNN_CACHES  # set by the actors' package where unset
    torch_default = {name: "1024" for name in ONEDNN_CACHES}
    unbounded = grown(torch_default)
    assert unbounded["caches"] == torch_default  # a user's own setting stays
    assert bounded["grown_mib"] < 400, bounded  # measured 130 MiB here
    if unbounded["grown_mib"] < 2 * bounded["grown_mib"]:
        pytest.skip(f"torch's own caches did not grow here ({unbounded['grown_mib']:.0f} MiB)")
    assert unbounded["grown_mib"] > bounded["grown_mib"] + 300  # measured 1136 MiB here
