"""The held-out set: disjoint from the training prompts, whatever file it comes from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.trainer.resolve import resolve_data_path
from rlx.trainer.tasks.data import load_prompt_dataset
from rlx.trainer.tasks.validation import due, load_validation_set
from tests.support.recipes import trainer_section


def _settings(tmp_path: Path, **validation) -> TrainerSettings:
    return TrainerSettings.model_validate(
        trainer_section(tmp_path, steps=25, validation=validation)
    )


def _train(settings: TrainerSettings, tokenizer, run_dir: Path):
    path = resolve_data_path(settings.data.train, run_dir, settings.seed)
    return load_prompt_dataset(
        path,
        tokenizer,
        answer_key="answer",
        max_prompt_length=64,
        chat_template_for_strings=True,
    )


def test_synthetic_held_out_prompts_never_appear_in_training(tmp_path: Path, tiny_tokenizer):
    settings = _settings(tmp_path, data="synthetic:letters_or_digits", max_prompts=50)
    train = _train(settings, tiny_tokenizer, tmp_path)
    held_out, dropped = load_validation_set(settings, tiny_tokenizer, train, tmp_path)
    assert dropped == 0 and len(held_out) == 50
    seen = set(train.prompts)
    assert not seen & set(held_out.prompts)
    assert {a for a in held_out.answers} == {"digits", "letters"}


def test_prompts_shared_with_training_are_dropped(tmp_path: Path, tiny_tokenizer):
    mixed = tmp_path / "val.jsonl"
    rows = [
        {"prompt": "Write digits.", "answer": "digits"},  # a training prompt
        {"prompt": "Give me digits only.", "answer": "digits"},
        {"prompt": "Write letters.", "answer": "letters"},  # a training prompt
    ]
    mixed.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = _settings(tmp_path, data=str(mixed))
    train = _train(settings, tiny_tokenizer, tmp_path)
    held_out, dropped = load_validation_set(settings, tiny_tokenizer, train, tmp_path)
    assert dropped == 2 and len(held_out) == 1
    assert "Give me digits only." in held_out.prompts[0]

    only_training = tmp_path / "same.jsonl"
    only_training.write_text(json.dumps(rows[0]) + "\n")
    settings = _settings(tmp_path, data=str(only_training))
    with pytest.raises(RlxError, match=r"every prompt of .* also appears in the training data"):
        load_validation_set(settings, tiny_tokenizer, train, tmp_path)


def test_validation_runs_at_step_0_every_k_and_at_the_end(tmp_path: Path) -> None:
    settings = _settings(tmp_path, data="synthetic:letters_or_digits", every=10)
    assert [s for s in range(26) if due(settings, s)] == [0, 10, 20, 25]
    assert not due(TrainerSettings.model_validate(trainer_section(tmp_path)), 0)
