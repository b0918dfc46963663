"""LoRA in the learner (peft's adapters, no process): the reference is the base with the
adapters off and equals a separate frozen copy; only the adapters train; a checkpoint holds
them alone with the base's fingerprint and puts a learner back exactly; another base, or a
target the model lacks, is one line."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from rlx.errors import RlxError
from rlx.trainer.batch import REF_LOGP, RETURNS
from rlx.trainer.checkpoint.training import load_learner_state, save_learner_state
from rlx.trainer.learn.learner import Learner
from rlx.trainer.model import lora
from tests.support.recipes import small_trainer

pytestmark = pytest.mark.timeout(300)
LORA = {"rank": 8}


def settings(tmp_path: Path, model: Path, *, adapters: bool = True, **overrides):
    model_section = {"path": str(model), "dtype": "float32"}
    if adapters:
        model_section["lora"] = LORA
    return small_trainer(tmp_path, model=model_section, **overrides)


def test_names_map_to_the_base_and_to_peft_s_format() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert lora.base_name(name) == "model.layers.0.self_attn.q_proj.weight"
    adapter = "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"
    assert lora.is_adapter(adapter) and not lora.is_adapter(name)
    assert lora.peft_key(adapter) == "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"


def test_the_reference_is_the_base_and_only_the_adapters_train(
    tmp_path, tiny_model_dir, advantage_batch
) -> None:
    kl = {"kl": {"coef": 0.05, "mode": "loss"}}
    adapted = Learner(
        settings(tmp_path, tiny_model_dir, algo=kl), str(tiny_model_dir), None, torch.device("cpu")
    )
    full = Learner(
        settings(tmp_path, tiny_model_dir, adapters=False, algo=kl),
        str(tiny_model_dir),
        None,
        torch.device("cpu"),
    )
    assert adapted.reference is None  # no second copy of the model
    # Adapters at their start add nothing: the policy is its base, as is the reference.
    want = full.prepare(advantage_batch, old_logprobs=True)
    got = adapted.prepare(advantage_batch, old_logprobs=True)
    for field in want:
        assert float((got[field] - want[field]).abs().max()) <= 1e-6, field
    base = {n: p.detach().clone() for n, p in adapted.policy.named_parameters()}
    trained = {n for n, p in adapted.policy.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter(n) for n in trained)
    batch = advantage_batch.with_fields(**got)
    for step in (1, 2):
        stats = adapted.update(batch, step)
        assert stats.same["grad_norm"] > 0
    moved = {n for n, p in adapted.policy.named_parameters() if not torch.equal(p, base[n])}
    assert moved and moved <= trained  # the base never moves
    # After the update the reference is still the base: KL to a frozen copy's log-probs.
    again = adapted.prepare(advantage_batch, old_logprobs=True)
    assert float((again[REF_LOGP] - want[REF_LOGP]).abs().max()) <= 1e-6
    assert float((again["old_logp"] - want["old_logp"]).abs().max()) > 1e-4  # the policy moved


def test_a_checkpoint_holds_the_adapters_and_puts_a_learner_back(
    tmp_path, tiny_model_dir, advantage_batch
) -> None:
    conf = settings(
        tmp_path,
        tiny_model_dir,
        algorithm="ppo",
        critic_model={"path": str(tiny_model_dir), "dtype": "float32", "lora": LORA},
    )
    first = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    batch = advantage_batch.with_fields(
        **first.prepare(advantage_batch, old_logprobs=False),
        **{RETURNS: torch.where(advantage_batch.response_mask, 0.5, 0.0)},
    )
    first.update(batch, step=1)
    state = first.sharded_state()
    assert state["policy"] and all(lora.is_adapter(n) for n in state["policy"])
    assert set(state["critic"]) - {n for n in state["critic"] if lora.is_adapter(n)} == {
        "value_head.weight",
        "value_head.bias",
    }
    save_learner_state(state, tmp_path / "learner")
    parts = copy.deepcopy(first.state_parts())
    assert parts["lora"]["policy"]["peft_config"]["r"] == 8
    second = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    fresh = second.sharded_state()
    load_learner_state(fresh, tmp_path / "learner")
    second.load_sharded_state(fresh)
    second.load_parts(parts)
    first.update(batch, step=2)
    second.update(batch, step=2)
    for name, tensor in first.policy.state_dict().items():
        assert torch.equal(second.policy.state_dict()[name], tensor), name
    for name, tensor in first.critic.state_dict().items():
        assert torch.equal(second.critic.state_dict()[name], tensor), name

    # The same adapters on another base: one line, not a silent mix.
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    third = Learner(conf, str(other), str(other), torch.device("cpu"))
    with pytest.raises(RlxError, match=r"adapters were trained on .* and this run's base"):
        third.load_parts(parts)
    plain = Learner(
        settings(tmp_path, tiny_model_dir, adapters=False, algorithm="ppo"),
        str(tiny_model_dir),
        str(tiny_model_dir),
        torch.device("cpu"),
    )
    with pytest.raises(RlxError, match=r"lacks .*another trainer.model.lora"):
        plain_state = plain.sharded_state()
        load_learner_state(plain_state, tmp_path / "learner")
        plain.load_sharded_state(plain_state)


def test_the_base_fingerprint_sees_other_weights_of_the_same_shapes(tmp_path) -> None:
    from rlx.trainer.model.tiny import build_tiny_model

    one = build_tiny_model(tmp_path / "one", seed=0)
    same = build_tiny_model(tmp_path / "same", seed=0)
    wider = build_tiny_model(tmp_path / "wider", seed=0, embedding_std=0.1)  # embeddings only
    other = build_tiny_model(tmp_path / "other", seed=1)
    fingerprint = lora.base_fingerprint(str(one))
    assert lora.base_fingerprint(str(same)) == fingerprint
    assert lora.base_fingerprint(str(wider)) != fingerprint
    assert lora.base_fingerprint(str(other)) != fingerprint


def test_a_target_the_model_lacks_is_one_line(tmp_path, tiny_model_dir) -> None:
    conf = small_trainer(
        tmp_path,
        model={
            "path": str(tiny_model_dir),
            "dtype": "float32",
            "lora": {"rank": 4, "target_modules": ["qkv_proj"]},
        },
    )
    with pytest.raises(RlxError, match=r"^trainer.model.lora.target_modules: .*qkv_proj"):
        Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
