"""Shared fixtures: one tiny random model folder per test session (built, never downloaded),
a private Ray, and a Ray cluster of several nodes on this machine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlx.trainer.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def local_ray():
    """A private Ray for the tests of one module, with room for a few actors."""
    ray = pytest.importorskip("ray")
    import logging

    from rlx.trainer.main import read_ray_auth_mode_afresh

    read_ray_auth_mode_afresh()  # an earlier module's cluster may have left another mode
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def advantage_batch(tiny_model_dir: Path):
    """16 samples (4 prompts x 4) from the tiny model, with fixed random advantages: a step
    the Learner tests update on."""
    import torch

    from rlx.trainer.batch import ADVANTAGES, pack_rollout
    from rlx.trainer.rollout.base import SamplingArgs
    from rlx.trainer.rollout.hf import HFEngine

    engine = HFEngine(tiny_model_dir)
    prompts = [[256, 72, 105], [256, 65, 66, 67, 68], [256, 49], [256, 100, 101]]
    rollout = engine.generate(prompts, SamplingArgs(4, max_new_tokens=12, min_new_tokens=3), seed=0)
    batch = pack_rollout(rollout)
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(batch.response_mask.shape, generator=generator)
    return batch.with_fields(**{ADVANTAGES: torch.where(batch.response_mask, advantages, 0.0)})


@contextlib.contextmanager
def ray_nodes_here(nodes: int = 2, env: Mapping[str, str] | None = None) -> Iterator[Any]:
    """A Ray cluster of `nodes` nodes on this machine (ray.cluster_utils: one raylet each, one
    CPU each), without a token whatever this process carries; its workers import this
    checkout and have `env` in their environment, as a cloud node has its own."""
    from ray.cluster_utils import Cluster

    from tests.conftest import REPO

    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        patch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        # A loopback test cluster without a token, whatever Ray auth settings this process
        # carries (Ray reads them from the environment, for the cluster and its clients).
        patch.setenv("RAY_AUTH_MODE", "disabled")
        for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            patch.delenv(name, raising=False)
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        try:
            yield cluster
        finally:
            cluster.shutdown()


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """The tiny model served offline under the hub id the small shipped recipes name."""
    from tests.support.hub import fill_hub_cache

    return fill_hub_cache(tmp_path_factory.mktemp("hub"), tiny_model_dir)


@pytest.fixture(scope="session")
def dataset_cache(tmp_path_factory: pytest.TempPathFactory):
    """The quickstart's task as a dataset repository served offline by id
    (tests.support.hub.DATASET_ID)."""
    from tests.support.hub import fill_dataset_cache, write_dataset_repo

    files = write_dataset_repo(tmp_path_factory.mktemp("dataset-repo"))
    return fill_dataset_cache(tmp_path_factory.mktemp("dataset-hub"), files)
