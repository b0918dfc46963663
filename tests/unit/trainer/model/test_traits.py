"""A model's traits (rlx.trainer.model.traits): read through whatever wraps the transformers
model, and the answers the learner and the HF engine act on."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlx.recipe.model import LoraSettings
from rlx.trainer.learn.models import ValueModel
from rlx.trainer.model import lora
from rlx.trainer.model.attention import use_segment_attention
from rlx.trainer.model.traits import SEGMENT_ATTENTION, traits, transformers_model


def test_a_tiny_model_packs_shares_and_decodes(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    facts = traits(model)
    assert facts.attention == "sdpa" and facts.full_attention and not facts.stateful
    assert facts.packing_obstacle is None and facts.shares_packed_prompts
    assert facts.can_attend_by_segments and not facts.attends_by_segments
    assert not facts.varlen and facts.decode_obstacle is None
    assert facts.dtype == torch.float32
    assert facts.shares_prefill(training=True)
    use_segment_attention(model)
    switched = traits(model)  # read again after the switch
    assert switched.attention == SEGMENT_ATTENTION and switched.attends_by_segments
    assert switched.shares_packed_prompts and switched.decode_obstacle is None


def test_wrappers_are_seen_through(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    wrapped = lora.add_adapters(model, LoraSettings(rank=2))
    facts = traits(wrapped)
    assert transformers_model(wrapped) is model and facts.module is model
    assert facts.name == type(model).__name__
    assert facts.wrapper == type(wrapped).__name__  # what the packing lines name
    critic = ValueModel(model.model, model.config.hidden_size)
    assert traits(critic).attention == "sdpa" and traits(critic).module is model.model


def test_unnamed_attention_is_eager_and_other_kinds_keep_packing_off(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config._attn_implementation = None
    assert traits(model).attention == "eager" and traits(model).shares_packed_prompts
    model.config._attn_implementation = "flex_attention"
    facts = traits(model)
    assert facts.packing_obstacle == (
        f"{type(model).__name__} runs flex_attention attention; packing is exact with "
        "sdpa, eager, flash_attention_2, flash_attention_3, rlx_segments"
    )
    assert not facts.shares_packed_prompts and not facts.can_attend_by_segments
    assert facts.decode_obstacle == "it runs flex_attention attention"
    model.config._attn_implementation = "flash_attention_2"
    assert traits(model).varlen and traits(model).packing_obstacle is None
    checkpointed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    checkpointed.gradient_checkpointing_enable()
    facts = traits(checkpointed)
    assert facts.checkpointing and not facts.shares_prefill(training=True)
    assert facts.shares_prefill(training=False)


def test_a_module_without_a_config_has_none_of_them() -> None:
    facts = traits(torch.nn.Linear(2, 2))
    assert not facts.has_config and facts.packing_obstacle == "Linear has no transformers config"
    assert not facts.shares_packed_prompts and not facts.can_attend_by_segments
    assert not facts.shares_prefill(training=False)
