"""Episodes on the HF engine in this process: environments that raise, hang or see a
malformed call fail or flag their own episode in one line while the step goes on; too many
failures stop it; turns and tokens stay within the budget; the trajectory is the sampled ids
and the environment's, and only the model's tokens carry gradient."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlx.recipe.model import TrainerSettings
from rlx.trainer import algos
from rlx.trainer.batch import ADVANTAGES, pack_rollout
from rlx.trainer.episodes.env import Row, Step, Turn
from rlx.trainer.episodes.runner import EnvironmentFailures, EpisodeRunner
from rlx.trainer.episodes.trajectory import check_trajectories
from rlx.trainer.learn.learner import Learner
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.hf import HFEngine
from rlx.trainer.rollout.probe import PROBE_TOLERANCE_FLOOR, PROBE_TOLERANCE_PER_TOKEN
from rlx.trainer.tasks.data import load_recipe_prompts
from tests.support.episodes import Ready, learner_gaps, run_episodes, settings_for, write_prompts
from tests.support.gradients import gradient_of_update

pytestmark = pytest.mark.timeout(300)


class Misbehaves:
    """Row 0 raises at its first step, row 1 hangs, row 2 makes a malformed call and goes
    on, row 3 answers twice with a chat message and is done."""

    def reset(self, row: Row) -> None:
        self.kind = row.index
        self.turns = 0

    def step(self, turn: Turn) -> Step:
        self.turns += 1
        if self.kind == 0:
            raise RuntimeError("the tool crashed")
        if self.kind == 1:
            time.sleep(30)
        if self.kind == 2 and self.turns == 1:
            return Step(
                observation={"role": "tool", "content": "error: bad call"},
                tool_calls=1,
                tool_error=f"malformed call {turn.text[:5]!r}",
            )
        done = self.turns >= 2
        return Step(observation={"role": "tool", "content": "42"}, reward=1.0, done=done)


class Endless:
    """Never done; a long text observation every turn."""

    def reset(self, row: Row) -> None:
        pass

    def step(self, turn: Turn) -> Step:
        return Step(observation=" and so on" * 3, reward=0.5)


def settings(tmp_path: Path, **environment: Any) -> TrainerSettings:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(4))
    )
    return TrainerSettings.model_validate(
        {
            "model": {"path": "tiny:qwen2-h64-l2"},
            "data": {"train": str(data), "max_prompt_length": 64},
            "rollout": {"n": 2, "max_new_tokens": 8},
            "environment": {"function": "x.py:Env", **environment},
        }
    )


def episodes_of(tmp_path, tiny_model_dir, env, **environment):
    from transformers import AutoTokenizer

    conf = settings(tmp_path, **environment)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = load_recipe_prompts(Path(conf.data.train), tokenizer, conf.data)
    said: list[str] = []
    runner = EpisodeRunner(conf, env, tokenizer, data, said.append)
    engine = HFEngine(tiny_model_dir)
    seeds = iter(range(100))

    def submit(prompt_ids, sampling, stream):
        return Ready(engine.generate(prompt_ids, sampling, seed=next(seeds)))

    try:
        batch = runner.start([0, 1, 2, 3], 7, submit, SamplingArgs(2, 8)).collect()
    finally:
        runner.close()
    return batch, said


def test_a_raising_a_hanging_env_and_a_malformed_call_each_say_one_line(
    tmp_path, tiny_model_dir
) -> None:
    started = time.monotonic()
    batch, said = episodes_of(
        tmp_path, tiny_model_dir, Misbehaves, step_timeout_s=0.5, max_failed_fraction=0.5
    )
    assert time.monotonic() - started < 20  # the hanging steps were not waited for
    spec = "x.py:Env"

    def failed(episode: int, row: int, why: str) -> str:
        return (
            f"step 7: episode {episode} (prompt row {row}) failed at turn 0: {why} in "
            f"environment {spec}; it trains nothing"
        )

    raised = "step() raised RuntimeError: the tool crashed"
    hung = "step() took longer than 0.5 s (step_timeout_s)"
    assert said[:4] == [
        failed(0, 0, raised),
        failed(1, 0, raised),
        failed(2, 1, hung),
        "step 7: 1 more episodes failed",
    ]
    assert said[4].startswith("step 7: 2 tool errors in 2 episodes, e.g. episode 4: malformed")
    assert len(said) == 5
    assert all("\n" not in line for line in said)
    episodes = batch.episodes
    assert [e.failure is not None for e in episodes] == [True] * 4 + [False] * 4
    assert batch.loss_mask is not None and not bool(batch.loss_mask[:4].any())
    assert [len(e.turns) for e in episodes[4:]] == [2, 2, 2, 2]
    assert batch.token_rewards is not None
    assert batch.token_rewards.sum(dim=1).tolist()[4:] == [1.0, 1.0, 2.0, 2.0]

    with pytest.raises(EnvironmentFailures) as caught:
        episodes_of(
            tmp_path, tiny_model_dir, Misbehaves, step_timeout_s=0.5, max_failed_fraction=0.25
        )
    assert str(caught.value) == (
        f"step 7: 4 of 8 episodes failed in environment {spec}, more than "
        "trainer.environment.max_failed_fraction 0.25 allows; the run stops (the last "
        "checkpoint is kept); fix the environment and resume"
    )


def test_turns_and_tokens_stay_within_the_budget(tmp_path, tiny_model_dir) -> None:
    batch, said = episodes_of(tmp_path, tiny_model_dir, Endless, max_turns=5, max_tokens=40)
    assert said == []
    for episode in batch.episodes:
        assert len(episode.ids) <= 40 and len(episode.turns) <= 5
        assert episode.truncated and episode.done
        assert sum(episode.sampled) == sum(e - s for s, e in episode.turns)
    assert max(len(e.turns) for e in batch.episodes) >= 2
    batch, _ = episodes_of(tmp_path, tiny_model_dir, Endless, max_turns=2, max_tokens=400)
    assert all(len(e.turns) == 2 for e in batch.episodes)


def test_episodes_played_ahead_go_on_before_collect_and_equal_ones_played_there(
    tmp_path, tiny_model_dir
) -> None:
    """max_staleness > 0: a step's later turns are submitted from a thread of their own
    before the step is collected (the engines go on while the learners update), and the
    episodes are the ones a collect-time play makes; an error there reaches collect."""
    import threading

    from transformers import AutoTokenizer

    conf = settings(tmp_path, max_turns=3, max_tokens=200)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = load_recipe_prompts(Path(conf.data.train), tokenizer, conf.data)
    engine = HFEngine(tiny_model_dir)

    def play(ahead: bool, fail_at: str | None = None):
        runner = EpisodeRunner(conf, Endless, tokenizer, data, print)
        streams: list[tuple[str, str]] = []
        later_turn = threading.Event()

        def submit(prompt_ids, sampling, stream):
            streams.append((stream, threading.current_thread().name))
            if stream == fail_at:
                raise RuntimeError("the engine died")
            if stream != "generate":
                later_turn.set()
            seed = {"generate": 0}.get(stream, len(stream))
            return Ready(engine.generate(prompt_ids, sampling, seed=seed))

        try:
            pending = runner.start([0, 1, 2, 3], 7, submit, SamplingArgs(2, 8), ahead=ahead)
            if ahead and fail_at is None:  # turns 1 and 2 go on before anyone collects
                assert later_turn.wait(60), streams
            return pending.collect(), streams
        finally:
            runner.close()

    here, here_streams = play(ahead=False)
    ahead, ahead_streams = play(ahead=True)
    assert [s for s, _ in ahead_streams] == [s for s, _ in here_streams]
    assert [s for s, _ in here_streams] == ["generate", "generate/1", "generate/2"]
    assert {t for s, t in ahead_streams if s != "generate"} == {"episodes-7"}
    assert torch.equal(here.response_ids, ahead.response_ids)
    assert torch.equal(here.loss_mask, ahead.loss_mask)
    assert torch.equal(here.token_rewards, ahead.token_rewards)
    with pytest.raises(RuntimeError, match="the engine died"):
        play(ahead=True, fail_at="generate/1")


def test_the_hf_engine_trains_exactly_what_it_sampled(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.bpe import build_bpe_model

    model_dir = build_bpe_model(tmp_path / "bpe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conf = settings_for(model_dir, write_prompts(tmp_path / "p.jsonl", 8), 10, 2)
    engine = HFEngine(model_dir)
    rollout, _, said = run_episodes(engine, conf, tokenizer, prompts=8)
    assert said == []
    packed = pack_rollout(rollout)
    assert check_trajectories(packed, rollout.episodes, step=1) == int(packed.response_mask.sum())
    gaps = learner_gaps(AutoModelForCausalLM.from_pretrained(model_dir), packed, rollout)
    tokens = packed.response_mask.sum(dim=1).float()
    tolerance = torch.clamp(
        tokens * PROBE_TOLERANCE_PER_TOKEN["float32"], min=PROBE_TOLERANCE_FLOOR
    )
    assert bool((gaps <= tolerance).all()), gaps.max()


def test_environment_tokens_get_no_gradient(tmp_path, tiny_model_dir) -> None:
    from tests.support.recipes import small_trainer

    rollout, _ = episodes_of(tmp_path, tiny_model_dir, Endless, max_turns=3, max_tokens=40)
    packed = pack_rollout(rollout)
    real = rollout.response_mask  # (B, R) every token of the trajectory
    context = real & ~packed.response_mask  # the environment's tokens
    assert bool(context.any()) and bool(packed.response_mask.any())
    advantages, _ = algos.get_advantage_estimator("grpo")(
        rollout.token_rewards, packed.response_mask, group_size=2
    )
    assert not bool(advantages[context].any())  # the estimator leaves them at zero

    # The learner's own update: huge advantages on the environment's tokens change nothing,
    # a change on one of the model's tokens does.
    conf = small_trainer(tmp_path, optim={"grad_clip": 1e9}, batch={"micro_batch_size": 8})

    def gradient(values: torch.Tensor) -> dict[str, torch.Tensor]:
        learner = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
        return gradient_of_update(learner, packed.with_fields(**{ADVANTAGES: values}))

    base = gradient(torch.where(packed.response_mask, 1.0 + advantages, 0.0))
    loud = gradient(
        torch.where(context, 1e3, torch.where(packed.response_mask, 1.0 + advantages, 0.0))
    )
    for name, value in base.items():
        assert torch.equal(loud[name], value), name
    moved = torch.where(packed.response_mask, 1.0 + advantages, 0.0)
    row, col = packed.response_mask.nonzero()[0].tolist()
    moved[row, col] += 5.0
    changed = gradient(moved)
    assert any(not torch.equal(changed[n], v) for n, v in base.items())
