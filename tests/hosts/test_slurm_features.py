"""GPU alternatives on Slurm: a real slurmctld reads the rendered script's features. The
emulated nodes have features (h100 on two, a100 on one) and no GPUs, so the GPU count line is
left out and what is proven is the constraint: `sbatch --test-only` takes it, and the rendered
matching OR is refused at submission for three nodes (no three of one type), where a plain OR
takes all three, mixing the types."""

from __future__ import annotations

import os
import subprocess

import pytest

from rlx.launchers import render
from rlx.recipe import load_recipe
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

ALTERNATIVES_SET = REPO / "tests" / "recipes" / "alternatives-set.yaml"


def sbatch(cluster, script: str, tmp_path, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    return subprocess.run(
        ["sbatch", *flags, str(path)],
        env={**os.environ, **cluster.env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def with_nodes(script: str, nodes: int, partition: str, constraint: str | None = None) -> str:
    lines = []
    for line in script.splitlines():
        if line.startswith("#SBATCH --gpus-per-node="):
            continue  # the emulated nodes have features but no GPUs
        if line.startswith("#SBATCH --nodes="):
            line = f"#SBATCH --nodes={nodes}"
        if line.startswith("#SBATCH --partition="):
            line = f"#SBATCH --partition={partition}"
        if constraint and line.startswith("#SBATCH --constraint="):
            line = f"#SBATCH --constraint={constraint}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_sbatch_takes_the_gpu_features_of_one_type(slurm_cluster, tmp_path):
    script = render("slurm", load_recipe(ALTERNATIVES_SET).recipe, str(ALTERNATIVES_SET))
    assert "#SBATCH --constraint=[h100|a100]" in script.splitlines()
    part = slurm_cluster.partition
    two = sbatch(slurm_cluster, with_nodes(script, 2, part), tmp_path, "--test-only")
    assert two.returncode == 0, two.stderr  # two h100 nodes
    # three nodes exist, but only two of one type: refused, as a job of mixed GPUs should be
    three = sbatch(slurm_cluster, with_nodes(script, 3, part), tmp_path)
    assert three.returncode != 0
    assert "Requested node configuration is not available" in three.stderr
    # what a plain OR lets through (a job of `true`, on all three nodes)
    plain = ["--nodes=3", f"--partition={part}", "--constraint=h100|a100", "--wrap=true"]
    mixed = subprocess.run(
        ["sbatch", *plain],
        env={**os.environ, **slurm_cluster.env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert mixed.returncode == 0, mixed.stderr
    unknown = with_nodes(script, 2, part, "[h200|b200]")
    refused = sbatch(slurm_cluster, unknown, tmp_path, "--test-only")
    assert refused.returncode != 0 and "feature" in refused.stderr.lower(), refused.stderr
