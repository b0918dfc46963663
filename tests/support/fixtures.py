"""Shared fixtures: one tiny random model folder per test session (built, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlx.trainer.learn.tiny import build_tiny_model

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

    from rlx.trainer.batch import pack_rollout
    from rlx.trainer.learn.learner import ADVANTAGES
    from rlx.trainer.rollout.hf import HFEngine

    engine = HFEngine(tiny_model_dir)
    prompts = [[256, 72, 105], [256, 65, 66, 67, 68], [256, 49], [256, 100, 101]]
    rollout = engine.generate(prompts, 4, max_new_tokens=12, min_new_tokens=3, seed=0)
    batch = pack_rollout(rollout)
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(batch.response_mask.shape, generator=generator)
    return batch.with_fields(**{ADVANTAGES: torch.where(batch.response_mask, advantages, 0.0)})
