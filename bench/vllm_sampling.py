"""Generation tokens/s on vLLM's CPU build, two ways of seeding, next to HF generate.

    python bench/vllm_sampling.py [--repeats 5]

The same saved tiny model (rlx.trainer.model.tiny, Qwen2, float32) and the same prompts for
every engine; each call samples n responses per prompt at temperature 1 with a seed and
exactly max_new_tokens tokens (min_new_tokens = max_new_tokens, so every engine emits the
same number of tokens). Engines:
  - hf: rlx's HFEngine (transformers generate, prompt prefill shared per group);
  - vllm per-sample: one seeded request per sample (vLLM keeps a generator per request);
  - vllm batched: one request per prompt for its n samples, the workers' RNG reseeded and
    the scheduler paused until every request is queued (what VLLMEngine does).
Each seeded call is made twice with the same seed to check it repeats exactly. Figures are
the median of --repeats calls after one warm-up call. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlx.trainer.rollout.base import SamplingArgs

SHAPES = {  # name: (hidden, layers, prompts, n, new tokens)
    "quickstart (h64 l2)": (64, 2, 4, 16, 32),
    "larger (h256 l4)": (256, 4, 16, 16, 64),
}


def _timed(engine, prompts, n: int, tokens: int, seed: int, repeats: int) -> tuple[float, bool]:
    def call(s: int):
        return engine.generate(
            prompts,
            SamplingArgs(n, max_new_tokens=tokens, min_new_tokens=tokens, temperature=1.0),
            seed=s,
        )

    call(seed)  # warm-up
    times = []
    for r in range(repeats):
        started = time.perf_counter()
        call(seed + r)
        times.append(time.perf_counter() - started)
    repeat = torch.equal(call(seed).response_ids, call(seed).response_ids)
    total = len(prompts) * n * tokens
    return total / statistics.median(times), repeat


def main() -> None:
    from rlx.trainer.model.tiny import build_tiny_model
    from rlx.trainer.rollout.hf import HFEngine
    from rlx.trainer.rollout.vllm import VLLMEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.shapes:
            hidden, layers, n_prompts, n, tokens = SHAPES[name]
            folder = build_tiny_model(
                Path(scratch) / name.split()[0], hidden_size=hidden, num_layers=layers, seed=0
            )
            prompts = [[257, *(65 + (i + j) % 26 for j in range(12))] for i in range(n_prompts)]
            hf = HFEngine(folder, dtype="float32")
            rows.append((name, "hf generate", *_timed(hf, prompts, n, tokens, 1, args.repeats)))
            print(rows[-1], flush=True)
            engine = VLLMEngine(
                folder,
                dtype="float32",
                enforce_eager=True,
                kv_cache_memory_bytes=256 * 2**20,
                max_model_len=256,
                seed=0,
            )
            for per_sample, label in ((True, "vllm per-sample"), (False, "vllm batched")):
                engine.per_sample_seeds = per_sample
                rows.append((name, label, *_timed(engine, prompts, n, tokens, 1, args.repeats)))
                print(rows[-1], flush=True)
            engine.close()
            print(f"{name}: {n_prompts} prompts x {n} samples x {tokens} tokens", flush=True)
    print("| model | engine | tokens/s | same seed, same samples |")
    print("| --- | --- | ---: | --- |")
    for name, engine_name, rate, repeat in rows:
        print(f"| {name} | {engine_name} | {rate:,.0f} | {'yes' if repeat else 'NO'} |")


if __name__ == "__main__":
    main()
