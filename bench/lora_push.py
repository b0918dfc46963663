"""A LoRA push against a full push into one vLLM engine: bytes and seconds.

    python bench/lora_push.py [--layers 24] [--rank 8] [--repeats 5]

The model: random weights with Qwen2.5-0.5B's shape (bench/shapes.py; 24 layers is the
real model), float32. One vLLM engine (its CPU build here; in this process, as a colocated
engine runs) with LoRA enabled at the rank's slot. Each repeat pushes, in turn:
  - full: every weight of the model (what a push is without LoRA; here the base's own
    values, the adapters' base), through vLLM's layerwise reload, and proves it (the
    engine's probe log-prob equals the model's);
  - adapter: the rank-r adapters of every linear layer (peft's all-linear), built into a
    served adapter in the engine's worker, and proves it the same way.
Bytes are the tensors handed to the engine; seconds the push itself (load_weights), the
median over the repeats. The table gives both and adapter / full. The load average is
printed before and after: a figure taken on a busy machine is not a result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = [257, 72, 105, 33, 10, 65]
RESPONSE = [66, 67, 68, 69, 70, 71, 72, 73]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: the real)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

    import torch
    from shapes import write_qwen25_05b
    from transformers import AutoModelForCausalLM

    from rlx.plan.lora import vllm_lora_rank
    from rlx.recipe.model import LoraSettings
    from rlx.trainer.model.lora import add_adapters, init_adapters, served_config
    from rlx.trainer.model.push import engine_tensors
    from rlx.trainer.rollout.hf import HFEngine
    from rlx.trainer.rollout.vllm import VLLMEngine

    torch.set_num_threads(2)
    lora = LoraSettings(rank=args.rank)
    with tempfile.TemporaryDirectory(prefix="bench-lora-push-") as scratch:
        folder = write_qwen25_05b(Path(scratch) / "model", args.layers)
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        policy = add_adapters(
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), lora
        ).eval()
        init_adapters(policy, seed=0)
        slot = vllm_lora_rank(args.rank)
        engine = VLLMEngine(
            folder,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=256 * 2**20,
            max_model_len=256,
            seed=0,
            distributed_executor_backend="uni",
            enable_lora=True,
            max_lora_rank=slot,
            max_loras=2,
            max_cpu_loras=2,
            adapter_config=served_config(lora),
        )
        scorers = {"full": HFEngine(plain), "adapter": HFEngine(policy)}
        print(
            f"Qwen2.5-0.5B shape, {args.layers} layers, float32; LoRA rank {args.rank} "
            f"all-linear (vLLM slot {slot}); {args.repeats} repeats; torch threads 2; "
            f"load {load_average()}",
            flush=True,
        )
        seconds: dict[str, list[float]] = {"full": [], "adapter": []}
        sizes: dict[str, int] = {}
        worst: dict[str, float] = {"full": 0.0, "adapter": 0.0}
        config = engine.adapter_config
        version = 0
        for repeat in range(args.repeats):
            for kind in ("full", "adapter"):
                model = plain if kind == "full" else policy
                if kind == "adapter":
                    with torch.no_grad():  # an update: the adapters change (B moves)
                        for name, param in model.named_parameters():
                            if ".lora_B." in name:
                                param.add_(1e-3 * torch.randn_like(param))
                tensors = list(engine_tensors(model, torch.float32))
                sizes[kind] = sum(t.numel() * t.element_size() for _, t in tensors)
                version += 1
                engine.adapter_config = config if kind == "adapter" else None
                start = time.perf_counter()
                engine.load_weights(tensors, version)
                seconds[kind].append(time.perf_counter() - start)
                engine.adapter_config = config  # a full push's version is served as the base
                got = engine.logprob_probe(PROMPT, RESPONSE)
                want = scorers[kind].logprob_probe(PROMPT, RESPONSE)
                worst[kind] = max(worst[kind], abs(got - want))
            print(
                f"repeat {repeat + 1}: full {seconds['full'][-1]:.3f} s, adapter "
                f"{seconds['adapter'][-1]:.4f} s, load {load_average()}",
                flush=True,
            )
        engine.close()
    full, adapter = (statistics.median(seconds[k]) for k in ("full", "adapter"))
    print()
    print(f"{'':<22} {'full':>12} {'adapter':>12} {'adapter/full':>13}")
    print(
        f"{'bytes per push':<22} {sizes['full']:>12,} {sizes['adapter']:>12,} "
        f"{sizes['adapter'] / sizes['full']:>12.4f}x"
    )
    print(f"{'median s per push':<22} {full:>12.3f} {adapter:>12.4f} {adapter / full:>12.4f}x")
    print(f"{'probe difference':<22} {worst['full']:>12.2g} {worst['adapter']:>12.2g}")
    print(f"fewer bytes: {sizes['full'] / sizes['adapter']:.0f}x; load {load_average()}")


if __name__ == "__main__":
    main()
