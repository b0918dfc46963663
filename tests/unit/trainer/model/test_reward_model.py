"""The reward-model scorer: packed passes give the scores transformers' classifier gives each
sequence alone, no forward holds more than the token budget, conversations are rendered with
the reward model's own template, and a model that is not a one-label classifier is one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlx.errors import RlxError
from rlx.trainer.model.reward_model import RewardModelScorer, classifier_problem
from rlx.trainer.model.tiny import PAD_TOKEN, build_tiny_reward_model, build_tokenizer, token_id
from tests.support.hub import fill_hub_cache

# A template of the reward model's own, not the policy's ChatML.
RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward-models")
    return {
        arch: build_tiny_reward_model(root / arch, arch=arch, chat_template=RM_TEMPLATE, seed=1)
        for arch in ("qwen2", "llama")
    }


@pytest.fixture
def served(tmp_path: Path, reward_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    """The qwen2 reward model under a hub id, served offline."""
    cache = fill_hub_cache(tmp_path / "hub", reward_models["qwen2"], "rlx-tests/tiny-reward")
    for name, value in cache.env.items():
        monkeypatch.setenv(name, value)
    return cache


def skewed(count: int, seed: int) -> list[list[int]]:
    """Many short sequences and a few long ones, of byte tokens."""
    rng = random.Random(seed)
    sizes = [1, 2, 5, 9, 17, 30, 64, 150, 300]
    weights = [4, 4, 6, 6, 5, 4, 3, 2, 1]
    return [
        [rng.randrange(256) for _ in range(rng.choices(sizes, weights)[0])] for _ in range(count)
    ]


def alone(folder: Path, sequences: list[list[int]]) -> list[float]:
    """transformers' own classifier, one sequence a forward (its pad-token pooling)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        return [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in sequences]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_scores_equal_each_sequence_scored_alone(reward_models, arch: str) -> None:
    folder = reward_models[arch]
    sequences = skewed(40, seed=0)
    pad = token_id(PAD_TOKEN)
    sequences[3] = sequences[3] + [pad, pad]  # transformers reads before trailing pads
    sequences[4] = [pad]  # and position 0 of all-pad input
    scorer = RewardModelScorer(str(folder), token_budget=256)
    got = scorer.score_token_ids(sequences)
    want = alone(folder, sequences)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert len(scorer.forwards) < len(sequences) / 4  # packed, not one at a time
    assert len(set(round(s, 3) for s in got)) > len(got) / 2  # scores differ


def test_no_forward_holds_more_than_the_budget_a_longer_sequence_runs_alone(reward_models):
    folder = reward_models["qwen2"]
    sequences = skewed(30, seed=3)
    longest = max(len(ids) for ids in sequences)
    assert longest == 300
    scorer = RewardModelScorer(str(folder), token_budget=128)
    got = scorer.score_token_ids(sequences)
    over = [tokens for tokens in scorer.forwards if tokens > 128]
    too_long = sorted(len(ids) for ids in sequences if len(ids) > 128)
    assert sorted(over) == too_long  # each in a forward of its own, exactly its length
    assert sum(scorer.forwards) <= 1.25 * sum(len(ids) for ids in sequences)
    want = alone(folder, sequences)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


def test_a_hub_id_resolves_and_conversations_render_with_the_models_own_template(served):
    scorer = RewardModelScorer(served.repo_id, token_budget=512)
    assert scorer.folder == served.snapshot
    conversations = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    ]
    by_hand = [
        "".join(f"[{m['role']}] {m['content']}\n" for m in conversation)
        for conversation in conversations
    ]
    ids = [list(text.encode()) for text in by_hand]  # the byte tokenizer: id == byte
    assert [scorer.render(c) for c in conversations] == ids
    assert scorer.score_conversations(conversations) == scorer.score_token_ids(ids)
    want = alone(served.snapshot, ids)
    got = scorer.score_conversations(conversations)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


def test_a_tokenizer_is_shared_when_every_token_has_the_same_id(reward_models):
    scorer = RewardModelScorer(str(reward_models["qwen2"]))
    policy = build_tokenizer()  # ChatML, the reward model's template differs: ids still agree
    assert scorer.shares_tokenizer(policy)
    policy.add_tokens(["<|tool|>"])
    assert not scorer.shares_tokenizer(policy)


def test_a_model_that_is_not_a_one_label_classifier_is_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RlxError) as causal:
        RewardModelScorer(str(tiny_model_dir), field="trainer.rewards[0].model")
    line = str(causal.value)
    assert "\n" not in line and str(tiny_model_dir) in line
    assert line.startswith("trainer.rewards[0].model: ")
    assert "Qwen2ForCausalLM, not a sequence classifier" in line
    three = build_tiny_reward_model(tmp_path / "three", num_labels=3, num_layers=1)
    with pytest.raises(RlxError, match=r"with 3 labels; a reward model has one$") as labels:
        RewardModelScorer(str(three))
    assert "\n" not in str(labels.value) and str(three) in str(labels.value)
    with pytest.raises(RlxError, match="is not a folder nor a hub id"):
        RewardModelScorer(str(tmp_path / "absent"))
    assert classifier_problem({"architectures": ["LlamaForSequenceClassification"]}) == (
        "is a sequence classifier with 2 labels; a reward model has one"
    )


def test_a_model_that_cannot_attend_by_segments_packs_with_the_position_ids_mask(tmp_path: Path):
    """A sliding window (wider than any sequence here) keeps segment attention off: the
    passes then run transformers' block-diagonal mask from the restarting position ids."""
    folder = build_tiny_reward_model(tmp_path / "window", num_layers=1)
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    (folder / "config.json").write_text(json.dumps(config))
    scorer = RewardModelScorer(str(folder), token_budget=256)
    assert not scorer.by_segments
    sequences = skewed(40, seed=0)
    got = scorer.score_token_ids(sequences)
    assert max(scorer.forwards) == max(len(ids) for ids in sequences) == 300
    assert sorted(scorer.forwards)[-2] <= 256
    want = alone(folder, sequences)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
