"""rlx on one GPU in minutes: its learner, engine, sharding and checkpoints, against the plan.

    python bench/gpu_check.py [--device cuda|cpu] [--tiny] [--out DIR] [--parts a,b] [--deadline S]

No Ray, no vLLM, no network: the classes the trainer runs (Learner, HFEngine, the decode step,
FSDP2 sharding, DCP checkpoints, the memory plan) on random-weight models of real shapes
(rlx.plan.shapes' built-in table), written to a scratch folder first. Parts:
  machine      GPU (or CPU) name and memory, torch/CUDA/NCCL versions; a matrix product's
               measured FLOP/s (bf16 on GPU, fp32 on CPU) and a copy's memory bandwidth
  learner-*    GRPO steps of the Learner with packing, the trainer settings of a shipped recipe
               (gsm8k-grpo at Qwen2.5-0.5B, grpo-async at 1.5B, gsm8k-lora-7b at 7B with LoRA
               over its frozen bf16 base), fewer prompts per step: seconds per step (prepare +
               update), tokens/s, model FLOP/s and MFU (docs/gpu.md counts the FLOPs), peak
               memory against what `rlx plan` books for the learner on this GPU
  fsdp-dcp     FSDP2 at world size 1 (NCCL on GPU, gloo on CPU): an update, a DCP save from
               device memory, a second update; a fresh sharded Learner loads the save and
               repeats the second update: its loss must equal the first's
  packing      a batch's log-probs packed (as the learner plans its passes) against each
               sequence scored alone, in bf16 and fp32, beside the probe's tolerance
  decode       the HF engine's own decode step against transformers' generate: greedy
               tokens equal, tokens/s at a batch of 64 (8 with --tiny)
  mismatch     an engine in bf16 samples; the learner scores the same tokens (its compute
               dtype, and float32): rlx.trainer.algos.mismatch's figures
Each part runs within its share of time (a bounded number of steps), is skipped with one line
where what it needs is missing (no GPU, no NCCL, no peft), and its failure is one line; the
others go on, and the JSON file (--out, default bench/results/) is written after each part.
Exit 0 when it ran, whatever the figures. `--device cpu --tiny` runs every part at tiny shapes
in seconds (the suite runs it, so the script never rots); `--device cpu` at full shapes gives
this machine's roofline (learner FLOP/s over the matrix peak, the decode step's weight bytes
per second over the measured bandwidth). docs/gpu.md says how to run it on a GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # rlx from this checkout where it is not installed
    sys.path.insert(0, str(REPO))

GIB = 2**30
# Dense bf16 peak of the GPUs rlx plans for, TFLOP/s (the makers' datasheets, SXM parts):
# MFU is model FLOP/s over this. The measured product's rate is printed beside it.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A100-80GB": 312.0, "L4": 121.0}
PLAN_PROMISE = 0.15  # the plan's learner figure within this share of the measured peak
# Seconds each part may run (model files written and loaded included) before the check goes
# on without it; the H100 run took 62 s for the 0.5B learner and 99 s for the 7B one.
PART_BOUND_S = {"default": 150.0, "learner-7b-lora": 240.0, "tiny": 300.0}


class Skip(Exception):
    """A part's prerequisite is missing: one line, and the other parts go on."""


@dataclass(frozen=True)
class Case:
    """A learner part: a model of the built-in table trained with a shipped recipe's
    trainer settings (fewer prompts per step, so that a step takes seconds)."""

    part: str
    model: str  # rlx.plan.shapes.builtin_configs key
    recipe: str  # recipes/<recipe>.yaml


CASES = (
    Case("learner-0.5b", "qwen2.5-0.5b", "gsm8k-grpo"),
    Case("learner-1.5b", "qwen2.5-1.5b", "grpo-async"),
    Case("learner-7b-lora", "qwen2.5-7b", "gsm8k-lora-7b"),
)
# The cheap parts first: a deadline that cuts the run cuts the largest models.
PARTS = ("machine", "learner-0.5b", "fsdp-dcp", "packing", "decode", "mismatch")
PARTS += tuple(c.part for c in CASES[1:])
# On a CPU at full shapes a step of the shipped batch takes minutes: a few prompts of
# shorter lengths measure the same rates. (prompts per step, prompt length, response length)
CPU_BATCH = (2, 128, 128)
TINY_BATCH = (2, 16, 24)
# A tiny stand-in for every shape: what --tiny builds (head size 16, vocabulary 512).
TINY_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
EOS_ID = 2  # the random models' end-of-sequence token (an id every shape has)


@dataclass
class Check:
    """What every part shares: the device, the shapes' scale, the scratch folder, the
    results so far (written to `json_path` after each part)."""

    device: Any  # torch.device
    tiny: bool
    scratch: Path
    json_path: Path
    steps: int
    results: dict[str, Any]
    running: str = ""  # the part under way (what a deadline cuts)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def write(self) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.json_path)


# --------------------------------------------------------------------------- helpers


def say(line: str) -> None:
    print(line, flush=True)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_config(name: str, tiny: bool) -> dict[str, Any]:
    from rlx.plan.shapes import builtin_configs

    config = dict(TINY_CONFIG if tiny else builtin_configs()[name])
    config.update(bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    return config


def write_model(check: Check, name: str, dtype: str) -> Path:
    """A random-weight model of the shape in scratch (once per shape and dtype), built on
    the device (fast even at 7B) and saved as safetensors with a generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = check.scratch / "models" / f"{name}-{dtype}{'-tiny' if check.tiny else ''}"
    if (folder / "config.json").is_file():
        return folder
    settings = model_config(name, check.tiny)
    config = AutoConfig.for_model(**settings)
    with torch.random.fork_rng(devices=[]), torch.device(check.device):
        torch.manual_seed(0)
        if check.cuda:
            torch.cuda.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    model.save_pretrained(folder)
    del model
    free_memory(check.device)
    return folder


def free_memory(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def trainer_recipe(check: Check, case: Case, folder: Path, accelerator: str) -> Any:
    """The Recipe of a learner part: the shipped recipe's model, batch, rollout lengths,
    algo, optimiser and micro-batch settings (smaller batches on CPU: CPU_BATCH), on this
    model folder, one node with one GPU of this kind (what the plan books), the HF engine
    colocated, packing on."""
    import yaml

    from rlx.recipe import parse_recipe

    shipped = yaml.safe_load((REPO / "recipes" / f"{case.recipe}.yaml").read_text())["trainer"]
    model = {"path": str(folder)}
    for key in ("gradient_checkpointing", "lora"):
        if key in shipped["model"]:
            model[key] = shipped["model"][key]
    rollout = shipped["rollout"]
    n, response = rollout["n"], rollout["max_new_tokens"]
    prompt_length = shipped["data"]["max_prompt_length"]
    prompts = shipped["batch"]["prompts_per_step"]
    if check.tiny or not check.cuda:
        prompts, prompt_length, response = TINY_BATCH if check.tiny else CPU_BATCH
        n = 4 if check.tiny else n
    batch = {"prompts_per_step": prompts, "packing": True}
    for key in ("micro_batch_size", "max_tokens_per_micro_batch"):
        if key in shipped["batch"]:
            batch[key] = shipped["batch"][key]
    trainer = {
        "algorithm": shipped.get("algorithm", "grpo"),
        "model": model,
        "data": {"train": "synthetic:letters_or_digits", "max_prompt_length": prompt_length},
        "reward": {"function": "letters_or_digits"},
        "rollout": {"engine": "hf", "n": n, "max_new_tokens": response, "temperature": 1.0},
        "algo": shipped.get("algo", {}),
        "optim": shipped.get("optim", {}),
        "batch": batch,
        "steps": 1000,
        "seed": 0,
        "logging": {"dir": str(check.scratch / "runs"), "tensorboard": False},
    }
    resources: dict[str, Any] = {"nodes": 1}
    if accelerator:
        resources["accelerators"] = f"{accelerator}:1"
    recipe = {
        "name": "gpu-check-" + case.part.replace(".", ""),
        "resources": resources,
        "trainer": trainer,
    }
    return parse_recipe(json.dumps(recipe), f"{case.part}.yaml").recipe


def learner_plan(recipe: Any) -> tuple[int, dict[str, int]]:
    """What `rlx plan` books for the learner on one training GPU: the update phase's items
    (name -> bytes) and their sum without the fixed runtime item, the figure compared with
    torch's peak allocated bytes."""
    from rlx.plan.planner import plan_recipe

    budget = plan_recipe(recipe, advise=False).gpus[0]
    items = {i.name: i.bytes for i in budget.items if i.phase in ("all", "update")}
    planned = sum(size for name, size in items.items() if not name.startswith("runtime"))
    return planned, items


def skewed_batch(settings: Any, vocab: int, seed: int = 0) -> Any:
    """A GRPO step's samples as the engines return them: prompts of mixed length, n responses
    each of skewed lengths (most short, a few up to max_new_tokens), random tokens, GRPO
    advantages from random 0/1 rewards."""
    import torch

    from rlx.trainer import algos
    from rlx.trainer.batch import ADVANTAGES, RolloutBatch, pack_rollout

    g = torch.Generator().manual_seed(seed)
    prompts, n = settings.batch.prompts_per_step, settings.rollout.n
    most_prompt, most_response = settings.data.max_prompt_length, settings.rollout.max_new_tokens
    prompt_ids = []
    for _ in range(prompts):
        length = int(torch.randint(most_prompt // 4, most_prompt + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt_ids += [ids] * n
    rows = prompts * n
    # lengths ~ most_response * u^2: a mean of a third, a long tail to the limit
    u = torch.rand(rows, generator=g)
    lengths = (most_response * u.square()).long().clamp(min=1)  # (B,)
    responses = torch.randint(3, vocab, (rows, most_response), generator=g)  # (B, R)
    mask = torch.arange(most_response)[None, :] < lengths[:, None]  # (B, R)
    responses = torch.where(mask, responses, 0)
    rollout = RolloutBatch(
        prompt_ids=prompt_ids,
        response_ids=responses,
        response_mask=mask,
        logprobs=torch.zeros(rows, most_response),
        finished=lengths < most_response,
        n=n,
        pad_token_id=0,
        weight_version=0,
    )
    scores = torch.randint(0, 2, (rows,), generator=g).float()
    advantages = algos.broadcast_to_tokens(algos.grpo_advantages(scores, n), mask)
    return pack_rollout(rollout).with_fields(**{ADVANTAGES: advantages})


def matmul_params(model: Any) -> int:
    """Weights that take part in matrix products per token: every nn.Linear's (the output
    head included, tied or not); embeddings are look-ups."""
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def step_flops(batch: Any, config: Any, params: int, passes: int, trained: int) -> int:
    """Model FLOPs of a step (docs/gpu.md): 2 per matrix weight per token forward and 4
    backward (2 with a frozen base: input gradients only, `trained` = 2 then, else 4), plus
    attention's 4 per key per hidden unit per layer forward and twice that backward. A
    prompt shared by its group counts once (what the packed passes compute); recomputation
    under gradient checkpointing is not model FLOPs. passes: forwards without gradients."""
    mask = batch.attention_mask
    width = batch.prompt_width
    layers, hidden = config.num_hidden_layers, config.hidden_size
    total = 0
    seen: set[tuple[int, ...]] = set()
    for row in range(mask.shape[0]):
        prompt = batch.input_ids[row, :width][mask[row, :width].bool()].tolist()
        p = len(prompt)
        r = int(mask[row, width:].sum())
        tokens, keys = r, r * p + r * (r + 1) // 2
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            tokens, keys = tokens + p, keys + p * (p + 1) // 2
        linear, attention = 2 * params * tokens, 4 * layers * hidden * keys
        total += passes * (linear + attention) + (linear * (1 + trained // 2) + 3 * attention)
    return total


def distinct_tokens(batch: Any) -> int:
    """Tokens a step computes: each distinct prompt once, every response token."""
    width = batch.prompt_width
    prompts = {
        tuple(batch.input_ids[row, :width][batch.attention_mask[row, :width].bool()].tolist())
        for row in range(len(batch))
    }
    return sum(len(p) for p in prompts) + int(batch.attention_mask[:, width:].sum())


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def accelerator_of(check: Check) -> str:
    """The plan's name for this GPU; on CPU the plan is made for an H100 (labelled so)."""
    from rlx.plan.memory import device_accelerator

    if not check.cuda:
        return "H100"
    return device_accelerator(device_name(check.device)) or ""


@contextlib.contextmanager
def peak_memory(check: Check) -> Iterator[dict[str, int]]:
    """Peak device memory (allocated and reserved by torch's allocator) inside the block,
    from what is resident at its start."""
    import torch

    out: dict[str, int] = {}
    if check.cuda:
        torch.cuda.synchronize(check.device)
        torch.cuda.reset_peak_memory_stats(check.device)
    yield out
    if check.cuda:
        torch.cuda.synchronize(check.device)
        out["allocated"] = torch.cuda.max_memory_allocated(check.device)
        out["reserved"] = torch.cuda.max_memory_reserved(check.device)
        free, total = torch.cuda.mem_get_info(check.device)
        out["device_used_now"] = total - free


def timed(check: Check, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """fn(*args, **kwargs)'s wall seconds (the device's queue drained on both sides), value."""
    sync(check.device)
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    sync(check.device)
    return time.perf_counter() - start, value


# --------------------------------------------------------------------------- parts


def part_machine(check: Check) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "device": device_name(check.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        out.update(
            memory_gib=round(props.total_memory / GIB, 2),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            capability=f"{props.major}.{props.minor}",
        )
        dtype, size = torch.bfloat16, 8192
    else:
        flags = cpu_flags()
        out.update(
            cpus=os.cpu_count(),
            threads=torch.get_num_threads(),
            avx512=any(f.startswith("avx512") for f in flags),
            capability=torch.backends.cpu.get_cpu_capability(),
        )
        dtype, size = torch.float32, 2048
    if check.tiny:
        size = 256
    a = torch.randn(size, size, device=check.device, dtype=dtype)
    b = torch.randn(size, size, device=check.device, dtype=dtype)
    best = min(timed(check, lambda: a @ b)[0] for _ in range(5 if check.tiny else 10))
    out["matmul_tflops"] = round(2 * size**3 / best / 1e12, 3)
    out["matmul"] = f"{size}^3 {str(dtype).removeprefix('torch.')}"
    # memory bandwidth: a copy of 1 GiB (256 MiB on CPU), bytes read plus written
    elements = (2**28 if check.cuda else 2**26) // (64 if check.tiny else 1)
    src = torch.empty(elements, device=check.device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = min(timed(check, lambda: dst.copy_(src))[0] for _ in range(5))
    out["copy_gb_s"] = round(2 * src.numel() * 4 / best / 1e9, 1)
    peak = PEAK_BF16_TFLOPS.get(accelerator_of(check)) if check.cuda else None
    out["peak_bf16_tflops"] = peak
    return out


def learner_part(case: Case) -> Callable[[Check], dict[str, Any]]:
    def run(check: Check) -> dict[str, Any]:
        return part_learner(check, case)

    return run


def part_learner(check: Check, case: Case) -> dict[str, Any]:
    from rlx.trainer.job import runs_ahead
    from rlx.trainer.learn.learner import Learner, merge_update_stats, needs_old_logprobs

    accelerator = accelerator_of(check)
    # A LoRA base is stored in bf16 as the recipe's users load it; full models in float32
    # would double the file for nothing: the learner keeps float32 masters either way.
    lora = case.recipe == "gsm8k-lora-7b"
    if lora:
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
        if "peft" not in sys.modules:
            raise Skip("peft is not installed")
    folder = write_model(check, case.model, "bfloat16")
    recipe = trainer_recipe(check, case, folder, accelerator)
    settings = recipe.trainer
    out: dict[str, Any] = {"recipe": case.recipe, "model": case.model}
    if accelerator:
        try:
            planned, items = learner_plan(recipe)
        except Exception as exc:  # the plan's failure is a figure too; the steps still run
            out["plan_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            out["plan_gib"] = round(planned / GIB, 3)
            out["plan_items"] = {name: round(size / GIB, 3) for name, size in items.items()}
            out["plan_for"] = accelerator if check.cuda else f"{accelerator} (planned on CPU)"
    started = time.perf_counter()
    learner = Learner(settings, str(folder), None, check.device)
    out["load_s"] = round(time.perf_counter() - started, 2)
    config = learner.policy.config
    params = matmul_params(learner.policy)
    old = needs_old_logprobs(settings, runs_ahead(settings))
    passes = int(learner.reference_scorer is not None) + int(old)
    trained = 2 if lora else 4
    seconds, prepare_s, tokens, flops, losses = [], [], [], [], []
    with peak_memory(check) as memory:
        # On a GPU step 0 warms up (allocator, kernels) and is not measured; on a CPU, where
        # a full-shape step takes minutes, the first step is measured too.
        warm_up = 1 if check.cuda else 0
        for step in range(check.steps + warm_up):
            batch = skewed_batch(settings, config.vocab_size, seed=step)
            t_prepare, extra = timed(check, learner.prepare, batch, old_logprobs=old)
            batch = batch.with_fields(**extra)
            t_update, stats = timed(check, learner.update, batch, step)
            merged = merge_update_stats([stats])
            losses.append(merged.get("loss/policy", merged.get("loss", float("nan"))))
            if step == 0:
                out["notes"] = stats.notes
            if step < warm_up:
                continue
            seconds.append(t_prepare + t_update)
            prepare_s.append(t_prepare)
            tokens.append(distinct_tokens(batch))
            flops.append(step_flops(batch, config, params, passes, trained))
    s = sum(seconds) / len(seconds)
    rate = sum(flops) / sum(seconds)
    out.update(
        params_b=round(sum(p.numel() for p in learner.policy.parameters()) / 1e9, 3),
        packing=learner.planner.packing,
        steps=len(seconds),
        samples_per_step=settings.batch.prompts_per_step * settings.rollout.n,
        s_per_step=round(s, 3),
        prepare_s=round(sum(prepare_s) / len(prepare_s), 3),
        tokens_per_s=round(sum(tokens) / sum(seconds), 1),
        model_tflops=round(rate / 1e12, 6),
        losses_finite=all(math.isfinite(x) for x in losses),
    )
    peak = check.results.get("machine", {}).get("peak_bf16_tflops")
    if peak:
        out["mfu"] = round(rate / (peak * 1e12), 4)
    measured = check.results.get("machine", {}).get("matmul_tflops")
    if measured:
        out["share_of_matmul_peak"] = round(rate / (measured * 1e12), 4)
    if memory:
        out["peak_allocated_gib"] = round(memory["allocated"] / GIB, 3)
        out["peak_reserved_gib"] = round(memory["reserved"] / GIB, 3)
        if "plan_gib" in out:
            ratio = out["plan_gib"] / out["peak_allocated_gib"]
            out["plan_over_measured"] = round(ratio, 3)
            out["plan_within_promise"] = abs(ratio - 1) <= PLAN_PROMISE
    del learner
    free_memory(check.device)
    return out


def _process_group(check: Check) -> Any:
    import torch.distributed as dist

    if dist.is_initialized():
        return contextlib.nullcontext()
    backend = "nccl" if check.cuda else "gloo"
    if check.cuda and not dist.is_nccl_available():
        raise Skip("this torch has no NCCL")
    rendezvous = check.scratch / f"rendezvous-{os.getpid()}"
    rendezvous.unlink(missing_ok=True)
    kwargs: dict[str, Any] = {}
    if check.cuda:
        kwargs["device_id"] = check.device
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=0, world_size=1, **kwargs
    )

    @contextlib.contextmanager
    def group() -> Iterator[None]:
        try:
            yield
        finally:
            dist.destroy_process_group()

    return group()


def part_fsdp_dcp(check: Check) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from rlx.trainer.checkpoint.training import load_learner_state, save_learner_state
    from rlx.trainer.job import runs_ahead
    from rlx.trainer.learn.learner import Learner, merge_update_stats, needs_old_logprobs

    case = CASES[0]
    folder = write_model(check, case.model, "bfloat16")
    recipe = trainer_recipe(check, case, folder, accelerator_of(check))
    settings = recipe.trainer
    old = needs_old_logprobs(settings, runs_ahead(settings))
    out: dict[str, Any] = {"backend": "nccl" if check.cuda else "gloo", "model": case.model}

    def step(learner: Learner, seed: int) -> dict[str, float]:
        batch = skewed_batch(settings, learner.policy.config.vocab_size, seed=seed)
        batch = batch.with_fields(**learner.prepare(batch, old_logprobs=old))
        return merge_update_stats([learner.update(batch, seed)])

    with _process_group(check):
        first = Learner(settings, str(folder), None, check.device, strategy="fsdp")
        sharded = [p for p in first.policy.parameters() if isinstance(p, DTensor)]
        if not sharded:
            raise RuntimeError("the Learner did not shard its policy (no DTensor parameters)")
        step(first, 0)
        saved = check.scratch / "dcp"
        seconds, _ = timed(check, save_learner_state, first.sharded_state(), saved)
        out["save_s"] = round(seconds, 2)
        out["save_gib"] = round(sum(f.stat().st_size for f in saved.iterdir()) / GIB, 3)
        want = step(first, 1)
        del first
        free_memory(check.device)
        second = Learner(settings, str(folder), None, check.device, strategy="fsdp")
        state = second.sharded_state()
        seconds, _ = timed(check, load_learner_state, state, saved)
        second.load_sharded_state(state)
        out["load_s"] = round(seconds, 2)
        got = step(second, 1)
        del second
    free_memory(check.device)
    keys = sorted(k for k in want if k.startswith("loss") and k in got)
    gaps = {k: abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in keys}
    out["losses"] = {k: [want[k], got[k]] for k in keys}
    out["max_relative_gap"] = max(gaps.values()) if gaps else float("nan")
    out["equal"] = bool(gaps) and out["max_relative_gap"] <= 1e-6
    return out


def part_packing(check: Check) -> dict[str, Any]:
    from rlx.trainer.learn.learner import Learner
    from rlx.trainer.learn.passes import mean_gap, packing_tolerance
    from rlx.trainer.model.traits import traits
    from rlx.trainer.rollout.probe import Probe

    case = CASES[0]
    out: dict[str, Any] = {"model": case.model}
    for dtype in ("bfloat16", "float32"):
        folder = write_model(check, case.model, "bfloat16")
        recipe = trainer_recipe(check, case, folder, accelerator_of(check))
        trainer = recipe.trainer.model_copy(
            update={"model": recipe.trainer.model.model_copy(update={"dtype": dtype})}
        )
        learner = Learner(trainer, str(folder), None, check.device)
        batch = skewed_batch(trainer, learner.policy.config.vocab_size, seed=7)
        batch = batch.select(list(range(min(len(batch), 16))))

        def scores(mb: Any, packed: Any = None, learner: Learner = learner) -> Any:
            return learner._scores(learner.policy_scorer, mb, entropy_grad=False, packed=packed)

        with learner.no_grad():
            learner.planner.packing = True
            packed = learner._per_token(batch, lambda mb, p: scores(mb, p).logprobs)
            worst, worst_ratio, worst_tolerance, sums = 0.0, -1.0, 0.0, []
            for row in range(len(batch)):
                single = batch.select([row]).trimmed()
                own = scores(single.to(check.device)).logprobs.float().cpu()[0]
                mask = single.response_mask[0]
                got = packed[row, : own.shape[0]]
                scale = float(own[mask].abs().mean())
                gap = mean_gap(got, own, mask)
                tolerance = packing_tolerance(learner.dtype, scale)
                if gap / tolerance > worst_ratio:
                    worst, worst_ratio, worst_tolerance = gap, gap / tolerance, tolerance
                sums.append(abs(float((got - own)[mask].sum())))
        probe = Probe(prompt_ids=[0] * 8, response_ids=[0] * 14)
        out[dtype] = {
            "attention": "flash varlen"
            if traits(learner.policy).varlen
            else traits(learner.policy).attention,
            "packed_passes": learner.planner.packing,
            "worst_mean_gap": worst,
            "its_tolerance": worst_tolerance,
            "within": worst <= worst_tolerance,
            "largest_sequence_sum_gap": max(sums),
            "probe_tolerance_14_tokens": probe.tolerance(dtype),
        }
        del learner
        free_memory(check.device)
    return out


def part_decode(check: Check) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.trainer.rollout.base import SamplingArgs
    from rlx.trainer.rollout.hf import HFEngine

    case = CASES[0]
    rows, prompt_len, new = (8, 16, 16) if check.tiny else (64, 128, 128)
    if not check.cuda and not check.tiny:
        rows, prompt_len, new = 16, 64, 32  # a CPU step reads 2 GB of weights: seconds
    out: dict[str, Any] = {"model": case.model, "batch": rows, "max_new_tokens": new}
    g = torch.Generator().manual_seed(3)
    dtypes = ("bfloat16", "float32") if check.cuda else ("float32",)
    for dtype in dtypes:
        folder = write_model(check, case.model, "bfloat16")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        engine = HFEngine(model, device=check.device)
        vocab = model.config.vocab_size
        prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g)  # (B, P)
        greedy = SamplingArgs(n=1, max_new_tokens=new, temperature=0.0)
        # On a GPU each generation runs twice, the second timed: on an H100 the first bf16
        # one of a process ran at a fifth of the second's speed, both engines alike (900
        # against 4,600 tokens/s), also after a 4-token warm-up at the same batch.
        warm = new if check.cuda else 4
        engine.generate(prompts.tolist(), SamplingArgs(n=1, max_new_tokens=warm, temperature=0))
        ours_s, ours = timed(check, engine.generate, prompts.tolist(), greedy, seed=0)
        ids = prompts.to(check.device)
        kwargs = {"do_sample": False, "pad_token_id": 0}
        model.generate(input_ids=ids, max_new_tokens=warm, **kwargs)
        theirs_s, theirs = timed(check, model.generate, input_ids=ids, max_new_tokens=new, **kwargs)
        theirs = theirs[:, prompt_len:].cpu()
        same_rows, first_diff = 0, []
        for row, length in enumerate(ours.response_lengths.tolist()):
            a, b = ours.response_ids[row, :length], theirs[row, :length]
            differ = (a != b).nonzero()
            if len(differ) == 0:
                same_rows += 1
            else:
                first_diff.append(int(differ[0]))
        generated = int(ours.response_lengths.sum())
        out[dtype] = {
            "decode_step": engine.decoder is not None,
            "note": engine.decode_note,
            "rlx_tokens_per_s": round(generated / ours_s, 1),
            "transformers_tokens_per_s": round(theirs.numel() / theirs_s, 1),
            "rlx_over_transformers": round((generated / ours_s) / (theirs.numel() / theirs_s), 3),
            "rows_identical": f"{same_rows}/{rows}",
            "first_difference_at": min(first_diff) if first_diff else None,
            # every decode step reads every weight once (the batch shares them)
            "weight_gb_per_s": sum(p.numel() * p.element_size() for p in model.parameters())
            * (new / ours_s)
            / 1e9,
        }
        del engine, model
        free_memory(check.device)
    bandwidth = check.results.get("machine", {}).get("copy_gb_s")
    if bandwidth:
        last = out[dtypes[-1] if not check.cuda else "bfloat16"]
        last["share_of_copy_bandwidth"] = round(last["weight_gb_per_s"] / bandwidth, 4)
    return out


def part_mismatch(check: Check) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.trainer.algos.mismatch import mismatch_metrics
    from rlx.trainer.batch import OLD_LOGP, pack_rollout
    from rlx.trainer.learn.learner import Learner
    from rlx.trainer.rollout.base import SamplingArgs
    from rlx.trainer.rollout.hf import HFEngine

    case = CASES[0]
    folder = write_model(check, case.model, "bfloat16")
    recipe = trainer_recipe(check, case, folder, accelerator_of(check))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    engine = HFEngine(model, device=check.device)
    g = torch.Generator().manual_seed(5)
    prompts, n = (2, 4) if check.tiny else (8, 8)
    new = 16 if check.tiny else 256
    vocab = model.config.vocab_size
    prompt_ids = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(prompts)]
    rollout = engine.generate(
        prompt_ids, SamplingArgs(n=n, max_new_tokens=new, temperature=1.0), seed=0
    )
    del engine, model
    free_memory(check.device)
    batch = pack_rollout(rollout)
    out: dict[str, Any] = {
        "engine": "hf bfloat16",
        "sampled_tokens": int(batch.response_mask.sum()),
    }
    for dtype in ("auto", "float32") if check.cuda else ("float32",):
        trainer = recipe.trainer.model_copy(
            update={"model": recipe.trainer.model.model_copy(update={"dtype": dtype})}
        )
        learner = Learner(trainer, str(folder), None, check.device)
        learner_logp = learner.prepare(batch, old_logprobs=True)[OLD_LOGP]
        label = f"learner {str(learner.dtype).removeprefix('torch.')}"
        out[label] = mismatch_metrics(rollout.logprobs, learner_logp, batch.response_mask)
        del learner
        free_memory(check.device)
    return out


PART_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "machine": part_machine,
    **{case.part: learner_part(case) for case in CASES},
    "fsdp-dcp": part_fsdp_dcp,
    "packing": part_packing,
    "decode": part_decode,
    "mismatch": part_mismatch,
}


# --------------------------------------------------------------------------- the run


def part_bound(name: str, tiny: bool) -> float:
    """Seconds a part may take before the run goes on without it (PART_BOUND_S)."""
    return PART_BOUND_S["tiny"] if tiny else PART_BOUND_S.get(name, PART_BOUND_S["default"])


def run_part(check: Check, name: str) -> None:
    """One part, in a thread of its own bounded by part_bound: its figures, or one line that
    says it was skipped, failed or ran out of time (a part still running then is left to
    itself, the next part starts)."""
    started = time.perf_counter()
    check.running = name
    say(f"[gpu-check] {name} ...")
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome.update({"status": "ran", **PART_FUNCTIONS[name](check)})
        except Skip as why:
            outcome.update(status="skipped", why=str(why))
        except Exception as exc:  # one line; the other parts go on
            outcome.update(status="failed", why=f"{type(exc).__name__}: {exc}".splitlines()[0])
            if os.environ.get("RLX_DEBUG"):
                traceback.print_exc()
            free_memory(check.device)

    bound = part_bound(name, check.tiny)
    thread = threading.Thread(target=work, name=f"part-{name}", daemon=True)
    thread.start()
    thread.join(bound)
    result = dict(outcome) if not thread.is_alive() else {}
    if thread.is_alive():
        result = {"status": "timed out", "why": f"still running after {bound:.0f} s"}
    if result["status"] != "ran":
        say(f"[gpu-check] {name}: {result['status']}: {result['why']}")
    result["seconds"] = round(time.perf_counter() - started, 1)
    check.results[name] = result
    check.write()


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The table: one line per part with its main figures."""
    lines = []
    for name, r in results.items():
        if not isinstance(r, dict) or "status" not in r:
            continue
        if r["status"] != "ran":
            lines.append(f"{name:<16} {r['status']}: {r.get('why', '')}")
            continue
        keys = {
            "machine": ("device", "matmul_tflops", "copy_gb_s", "memory_gib", "cuda", "nccl"),
            "fsdp-dcp": ("backend", "save_s", "load_s", "max_relative_gap", "equal"),
            "packing": ("bfloat16", "float32"),
            "decode": ("bfloat16", "float32"),
            "mismatch": ("learner bfloat16", "learner float32"),
        }.get(
            name,
            (
                "s_per_step",
                "tokens_per_s",
                "model_tflops",
                "mfu",
                "share_of_matmul_peak",
                "peak_allocated_gib",
                "plan_gib",
                "plan_over_measured",
            ),
        )
        shown = ", ".join(f"{k}={_short(r[k])}" for k in keys if k in r)
        lines.append(f"{name:<16} {shown} ({r['seconds']} s)")
    return lines


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        inner = ", ".join(f"{k}={_short(v)}" for k, v in value.items() if not isinstance(v, dict))
        return "{" + inner + "}"
    return str(value)


def watchdog(check: Check, deadline: float) -> None:
    """Past the deadline the run stops where it is: what has been measured is in the JSON
    file already; one line says which part was cut."""

    def stop() -> None:
        say(f"[gpu-check] deadline of {deadline:.0f} s reached during {check.running}; stopping")
        check.results["cut_at"] = check.running
        check.write()
        os._exit(0)

    timer = threading.Timer(deadline, stop)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: seconds, for the suite")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per learner part")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for all parts")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PART_FUNCTIONS]
    if unknown:
        print(f"gpu_check: unknown part {unknown[0]!r}; use some of {', '.join(PARTS)}")
        return 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rlx.trainer.allocator import use_allocator_settings

    # The allocator a training worker runs with (no vLLM here), set before the first
    # allocation: the memory measured is the trainer's.
    use_allocator_settings(args.device == "cuda", holds_vllm=False)
    import torch

    from rlx.trainer.learn.models import quiet_transformers

    quiet_transformers()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --device cpu runs the same parts on the CPU")
        return 1
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tag = f"{args.device}{'-tiny' if args.tiny else ''}"
    # Model files in memory where there is room for them (7B in bf16 is 15 GB), else /tmp.
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 40 * GIB
    root = shm if roomy else None
    with tempfile.TemporaryDirectory(prefix="rlx-gpu-check-", dir=root) as scratch:
        check = Check(
            device=device,
            tiny=args.tiny,
            scratch=Path(scratch),
            json_path=args.out / f"gpu_check-{tag}.json",
            steps=1 if args.tiny else args.steps,
            results={"when": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": tag},
        )
        watchdog(check, args.deadline)
        for name in ("machine", *[p for p in parts if p != "machine"]):
            run_part(check, name)
    say("")
    for line in summary_lines(check.results):
        say(line)
    say(f"[gpu-check] figures in {check.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
