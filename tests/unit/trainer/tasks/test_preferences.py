"""The digits reward model made here: its pairs prefer what digit_share measures, and a
short Bradley-Terry training orders held-out pairs as they are preferred."""

from __future__ import annotations

from rlx.trainer.model.reward_model import RewardModelScorer
from rlx.trainer.tasks.preferences import digit_share, preference_pairs, train_reward_model
from rlx.trainer.tasks.rewards import resolve_reward


def test_pairs_prefer_the_response_with_more_digits():
    pairs = preference_pairs(200, seed=5)
    assert len(pairs) == 200 and pairs == preference_pairs(200, seed=5)
    for pair in pairs:
        chosen = digit_share(pair.prompt, pair.chosen, None)
        assert chosen >= digit_share(pair.prompt, pair.rejected, None) + 0.2
    assert resolve_reward("digit_share") is digit_share
    assert digit_share("", "12ab", None) == 2 / 16  # over at least MIN_CHARS characters


def test_a_short_training_orders_held_out_pairs(tmp_path):
    folder, accuracy = train_reward_model(tmp_path / "rm", pairs=512, epochs=2)
    assert accuracy >= 0.8, accuracy
    # It loads as a reward model rlx scores with, and scores more digits higher.
    scorer = RewardModelScorer(str(folder), token_budget=256)
    tokens = scorer.tokenizer
    prompt = list(tokens("Write digits.")["input_ids"])
    digits, letters = (
        list(tokens(text, add_special_tokens=False)["input_ids"])
        for text in ("4817 2930 5561", "house of cards")
    )
    high, low = scorer.score_token_ids([prompt + digits, prompt + letters])
    assert high > low
