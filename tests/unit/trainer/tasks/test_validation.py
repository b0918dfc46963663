"""The held-out set: disjoint from the training prompts, whatever file it comes from; the
figures validation reports from its samples."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.runs import validation_metrics
from rlx.trainer.resolve import resolve_data_path
from rlx.trainer.tasks.data import load_prompt_dataset
from rlx.trainer.tasks.validation import (
    due,
    finite_mean,
    load_validation_set,
    sampled_metrics,
    validate,
)
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


# --------------------------------------------------------------------------- the figures


def test_sampled_figures_are_rlx_evals_by_hand() -> None:
    # Two prompts, n = 4: the first has one correct sample (reward 1) of four, the second
    # none; graded rewards below the threshold are not correct but count in avg@4.
    scores = [0.0, 1.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.0]
    answers = ["7", "8", "7", "7", None, "3", "3", None]
    lengths = [10, 20, 30, 40, 5, 5, 5, 5]
    got = sampled_metrics(scores, answers, lengths, 4, 1.0, compares_answers=True)
    assert got == {
        "val/pass@1_sampled": pytest.approx((1 / 4 + 0) / 2),
        "val/pass@2": pytest.approx((1 - 3 / 6 + 0) / 2),  # C(3,2)/C(4,2) miss it
        "val/pass@4": pytest.approx((1.0 + 0) / 2),  # one correct of four: pass@4 = 1
        "val/avg@4": pytest.approx(1.75 / 8),
        "val/maj@4": 0.0,  # "7" wins the first prompt's vote and is wrong; "3" the second's
        "val/response_length": pytest.approx(120 / 8),
    }
    assert "val/maj@4" not in sampled_metrics(scores, answers, lengths, 4, 1.0, False)
    assert sampled_metrics(scores, answers, lengths, 4, 0.5, False)["val/pass@1_sampled"] == 0.25


def test_a_failed_sample_is_not_correct_and_leaves_avg() -> None:
    nan = float("nan")
    got = sampled_metrics([nan, 1.0, nan, nan], [None] * 4, [1] * 4, 2, 1.0, False)
    assert got["val/pass@1_sampled"] == pytest.approx(0.25)  # (0 + 1) / 2 correct, / 2 prompts
    assert got["val/avg@2"] == 1.0  # the one sample that was scored
    assert finite_mean([nan, nan]) != finite_mean([nan, nan])  # NaN: nothing scored


class _Batch:
    def __init__(self, rows: list[list[int]]):
        self.rows = rows
        self.response_lengths = torch.tensor([len(r) for r in rows])

    def response_lists(self) -> list[list[int]]:
        return self.rows


class _Cluster:
    def generate(self, prompts, step, show_progress, sampling, stream):
        n = sampling.n
        # the k-th sample of a prompt says str(k): "0" greedy, "0" "1" "2" "3" sampled
        return _Batch([[ord(str(k))] * (k + 1) for _ in prompts for k in range(n)])


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens):
        return [chr(row[0]) for row in ids]


def test_validation_logs_the_metrics_the_recipe_can_name(tmp_path: Path) -> None:
    """What validate returns is exactly what lint lets checkpoint.best name (runs.py)."""
    settings = TrainerSettings.model_validate(
        trainer_section(
            tmp_path,
            reward={"function": "gsm8k"},
            validation={"data": "synthetic:letters_or_digits", "n": 4},
        )
    )
    data = SimpleNamespace(
        prompts=["p", "q"], answers=["1", "9"], prompt_token_ids=[[1], [2]], messages=[]
    )

    def scorer(prompts, responses, answers, extra):
        return [1.0 if r == a else 0.0 for r, a in zip(responses, answers, strict=True)]

    got = validate(_Cluster(), data, None, _Tokenizer(), settings, 0, scorer=scorer)
    assert list(got) == validation_metrics(4, compares_answers=True)
    assert got["val/pass@1"] == 0.0 and got["val/pass@4"] == 0.5  # "1" is among p's four
    assert got["val/avg@4"] == got["val/reward_mean"] == 1 / 8
    assert got["val/response_length"] == 2.5
