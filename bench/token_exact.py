"""Token exactness of multi-turn episodes at scale, on vLLM's CPU build.

    python bench/token_exact.py [--episodes 1000] [--n 4] [--max-new-tokens 12]

A tiny random Qwen2 with a byte-pair tokenizer trained here (merges that cross turn
boundaries) and ChatML; an environment that answers in turn with a chat message, text glued
to the model's turn and raw ids (tests/support/episodes.py). The table: episodes, turns,
sampled ids checked, mismatches between the sampled and the trained ids (rlx's trajectory),
the learner's log-probs against the engine's (largest gap per episode and per token, and
the probe's tolerance), and the same episodes rebuilt by decode -> encode, as trainers that
re-tokenize do, with their mismatched ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=64, help="prompts per runner call")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.trainer.batch import pack_rollout
    from rlx.trainer.episodes.trajectory import (
        check_trajectories,
        count_mismatches,
        rebuild_from_text,
    )
    from rlx.trainer.rollout.probe import PROBE_TOLERANCE_FLOOR, PROBE_TOLERANCE_PER_TOKEN
    from rlx.trainer.rollout.vllm import VLLMEngine
    from tests.support.bpe import build_bpe_model
    from tests.support.episodes import learner_gaps, run_episodes, settings_for, write_prompts

    print(f"load average (1, 5, 15 min): {os.getloadavg()}", flush=True)
    prompts = -(-args.episodes // args.n)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model_dir = build_bpe_model(folder / "bpe")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        print(f"tokenizer: byte-pair, {len(tokenizer)} ids", flush=True)
        engine = VLLMEngine(
            model_dir,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=128 * 2**20,
            max_model_len=64 + 4 * 2 * args.max_new_tokens + 1,
            seed=0,
            distributed_executor_backend="uni",
        )
        policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        totals = dict.fromkeys(("episodes", "turns", "checked", "rebuilt", "rebuilt_episodes"), 0)
        worst_episode = worst_token = 0.0
        worst_ratio = 0.0
        started = time.perf_counter()
        for first in range(0, prompts, args.chunk):
            count = min(args.chunk, prompts - first)
            chunk = settings_for(
                model_dir,
                write_prompts(folder / f"p{first}.jsonl", count, seed=first),
                args.max_new_tokens,
                args.n,
            )
            rollout, data, said = run_episodes(engine, chunk, tokenizer, count)
            if said:
                print("\n".join(said))
            episodes = rollout.episodes
            packed = pack_rollout(rollout)
            totals["checked"] += check_trajectories(packed, episodes, step=1)
            totals["episodes"] += len(episodes)
            totals["turns"] += sum(len(e.turns) for e in episodes)
            gaps = learner_gaps(policy, packed, rollout)
            tokens = packed.response_mask.sum(dim=1).float()
            tolerance = torch.clamp(
                tokens * PROBE_TOLERANCE_PER_TOKEN["float32"], min=PROBE_TOLERANCE_FLOOR
            )
            worst_episode = max(worst_episode, float(gaps.max()))
            worst_token = max(worst_token, float((gaps / tokens.clamp(min=1)).max()))
            worst_ratio = max(worst_ratio, float((gaps / tolerance).max()))
            wrong = [
                count_mismatches(e, rebuild_from_text(e, data.prompts[e.row], tokenizer))
                for e in episodes
            ]
            totals["rebuilt"] += sum(wrong)
            totals["rebuilt_episodes"] += sum(w > 0 for w in wrong)
            print(f"  {totals['episodes']} episodes ...", flush=True)
        seconds = time.perf_counter() - started
        engine.close()
    rows = [
        ("episodes", f"{totals['episodes']}"),
        ("model turns", f"{totals['turns']}"),
        ("sampled ids checked", f"{totals['checked']}"),
        ("sampled != trained (rlx)", "0"),  # check_trajectories raised otherwise
        ("learner vs engine, worst episode", f"{worst_episode:.2e} nats"),
        ("learner vs engine, worst per token", f"{worst_token:.2e} nats"),
        ("worst episode / probe tolerance", f"{worst_ratio:.3f}"),
        ("decode -> encode rebuild: mismatched ids", f"{totals['rebuilt']}"),
        ("decode -> encode rebuild: episodes with one", f"{totals['rebuilt_episodes']}"),
        ("seconds (episodes + checks)", f"{seconds:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"load average after: {os.getloadavg()}")
    return 0 if worst_ratio <= 1.0 and totals["rebuilt"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
