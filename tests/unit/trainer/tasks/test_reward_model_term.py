"""A reward model as a term of trainer.rewards: it reads the policy's token ids as they are
where it shares the policy's tokenizer, else each prompt's messages and the response in its
own chat template; a forward that fails is NaN for the call's samples, never 0; the recipe
says which source a term has, in one line when it says it wrong."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlx.recipe.model import RewardTerm
from rlx.trainer.model.reward_model import RewardModelScorer
from rlx.trainer.model.tiny import build_tiny_reward_model, build_tokenizer
from rlx.trainer.tasks.reward_terms import ModelScorer, RewardInputs, RewardTerms, Term

# The reward model's own template, not the policy's.
RM_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> RewardModelScorer:
    folder = build_tiny_reward_model(
        tmp_path_factory.mktemp("rm") / "rm", chat_template=RM_TEMPLATE, seed=3
    )
    return RewardModelScorer(str(folder), token_budget=64)


def samples() -> tuple[list[str], list[str], RewardInputs]:
    prompts = ["What is 2+2? ", "Name a colour. "]
    responses = ["4", "Blue, or perhaps a very long answer about the sky " * 2]
    tokenizer = build_tokenizer()
    inputs = RewardInputs(
        prompt_ids=[tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
        response_ids=[tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses],
        messages=[[{"role": "user", "content": p.strip()}] for p in prompts],
    )
    return prompts, responses, inputs


def test_a_model_sharing_the_tokenizer_reads_the_policys_ids(reward_model):
    scorer = ModelScorer(reward_model)
    scorer.use_policy_tokenizer(build_tokenizer())  # the same byte-level vocabulary
    assert scorer.shares_tokens
    prompts, responses, inputs = samples()
    terms = RewardTerms([Term("rm", 1.0, scorer, "model tiny")])
    got = terms.score(prompts, responses, inputs=inputs).values[0].tolist()
    assert inputs.prompt_ids is not None and inputs.response_ids is not None
    want = reward_model.score_token_ids(
        [[*p, *r] for p, r in zip(inputs.prompt_ids, inputs.response_ids, strict=True)]
    )
    assert got == pytest.approx(want, abs=1e-6)


def test_a_model_of_another_tokenizer_reads_the_conversation_in_its_template(reward_model):
    scorer = ModelScorer(reward_model)  # told no policy tokenizer: nothing shared
    prompts, responses, inputs = samples()
    values, error = scorer(prompts, responses, [None, None], inputs)
    assert error is None
    assert inputs.messages is not None
    conversations = [
        [*m, {"role": "assistant", "content": r}]
        for m, r in zip(inputs.messages, responses, strict=True)
    ]
    assert values == pytest.approx(reward_model.score_conversations(conversations), abs=1e-6)
    # What it read is its own template's text, the response as the assistant's turn.
    text = reward_model.tokenizer.decode(reward_model.render(conversations[0]))
    assert text == "<user> What is 2+2?\n<assistant> 4\n"


def test_a_failed_forward_is_nan_for_every_sample_never_zero(reward_model):
    scorer = ModelScorer(reward_model)
    scorer.use_policy_tokenizer(build_tokenizer())
    prompts, responses, _ = samples()
    too_long = RewardInputs(prompt_ids=[[65] * 5000, [66]], response_ids=[[67], [68]])
    values, error = scorer(prompts, responses, [None, None], too_long)
    assert all(math.isnan(v) for v in values) and error is not None
    assert "RlxError" in error


def test_a_term_names_its_source_once(tmp_path: Path):
    term = RewardTerm(model="org/Skywork-Reward-V2-Llama-3.1-8B")
    assert term.label == "Skywork-Reward-V2-Llama-3.1-8B" and term.token_budget == 4096
    dumped = term.model_dump()
    assert "url" not in dumped and "function" not in dumped and "timeout_s" not in dumped
    assert RewardTerm.model_validate(dumped) == term
    assert "token_budget" not in RewardTerm(function="gsm8k").model_dump()
    with pytest.raises(ValidationError, match="sets model: and url:; give exactly one"):
        RewardTerm(model="org/rm", url="http://127.0.0.1:9/score")
    with pytest.raises(ValidationError, match="token_budget is for model: terms"):
        RewardTerm(function="gsm8k", token_budget=128)
    with pytest.raises(
        ValidationError, match="timeout_s is for url: terms and this term is a model"
    ):
        RewardTerm(model="org/rm", timeout_s=3)
