"""No traceback from any command on any recipe the schema accepts: recipes generated from the
shipped ones by changing the fields that feed lint, plan and render (nodes, accelerators and
their alternatives, counts, batch sizes incl. auto, strategy, layout, LoRA, engines,
checkpoint dirs incl. store URLs, groups, the backends' sections), each driven through
`rlx lint`, `rlx plan`, `rlx render` for every backend, `rlx launch --dry-run` and
`rlx rehearse --dry-run` in this process. Each command ends with exit 0, or exit 1 with at
most one `error:` line (rlx's one-line error; lint's findings are lines of their own), never
with an exception.

Property-based in the plain way: a seeded generator (hypothesis is not a dependency here), so
a failure names its seed and replays; RLX_ANY_RECIPE_EXAMPLES=2000 searches further."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers import renderable
from rlx.plan.sizing import AUTO_FIELDS
from rlx.recipe.model import Recipe
from tests.support.cli import error_lines
from tests.support.recipes import shipped_recipe_data

EXAMPLES = int(os.environ.get("RLX_ANY_RECIPE_EXAMPLES", "32"))
SCHEMA = Recipe.model_json_schema()
BASES = (
    "quickstart.yaml",
    "quickstart-lora.yaml",
    "gsm8k-grpo.yaml",
    "gsm8k-tools.yaml",
    "gsm8k-lora-7b.yaml",
    "ppo-7b.yaml",
    "grpo-async.yaml",
    "grpo-large.yaml",
)


def enum_values(definition: str, field: str) -> list[Any]:
    """The values the schema allows a field (its enum, or its anyOf's enums and consts)."""
    spec = SCHEMA["$defs"][definition]["properties"][field]
    values: list[Any] = list(spec.get("enum", []))
    for option in spec.get("anyOf", []):
        values += option.get("enum", [])
        values += [option["const"]] if "const" in option else []
    assert values, f"{definition}.{field} has no enum in the schema"
    return values


# dotted field -> what it may become (None removes it); the enums come from `rlx schema`.
FIELDS: dict[str, list[Any]] = {
    "resources.nodes": [1, 2, 3, 4, 8],
    "resources.accelerators": [
        None,
        "L4:1",
        "A10G:4",
        "H100:8",
        "A100-80GB:2",
        "H200:8",
        "T4:1",
        "H100",
        {"H100:8": None, "A100-80GB:8": None},
        ["L4:2", "A10G:2"],
        {"H100:8": None, "A100-40GB:4": None},
        "TPU-v9:4",
    ],
    "resources.fabric": [None, *enum_values("Resources", "fabric")],
    "resources.spot": [True, False, "auto"],
    "resources.memory": [None, "32+", "512", "4"],
    "resources.cpus": [None, "2+", "96+"],
    "resources.disk_size": [None, 10, 1000],
    "resources.max_hourly_cost": [None, 3.5],
    "resources.groups": [
        None,
        {"train": {"nodes": 2, "accelerators": "H100:8"}, "rollout": {"nodes": 1}},
        {
            "train": {"nodes": 1, "accelerators": "A100-80GB:4"},
            "rollout": {"nodes": 2, "accelerators": "L4:4"},
        },
    ],
    "trainer.algorithm": enum_values("TrainerSettings", "algorithm"),
    "trainer.layout": enum_values("TrainerSettings", "layout"),
    "trainer.rollout_gpus": [0, 1, 2, 4, 8, 16],
    "trainer.model.path": [
        "tiny:qwen2-h64-l2",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen3-4B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "acme/unknown-9b",
    ],
    "trainer.model.dtype": enum_values("ModelSettings", "dtype"),
    "trainer.model.gradient_checkpointing": [True, False],
    "trainer.model.lora": [None, {"rank": 8}, {"rank": 64, "target_modules": "all-linear"}],
    "trainer.critic_model": [None, {"path": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "trainer.rollout.engine": enum_values("RolloutSettings", "engine"),
    "trainer.rollout.n": [1, 2, 8, 16],
    "trainer.rollout.max_new_tokens": [1, 32, 2048, 40000],
    "trainer.rollout.tensor_parallel_size": ["auto", 1, 2, 3, 4, 8],
    "trainer.rollout.gpu_memory_utilization": ["auto", 0.05, 0.4, 0.9, 1.0],
    "trainer.rollout.max_staleness": [0, 1, 4],
    "trainer.environment": [None, {"function": "calculator", "max_turns": 2}],
    "trainer.batch.prompts_per_step": [1, 3, 4, 64, 512],
    "trainer.batch.minibatch_size": [None, 1, 8, 128, 1024],
    "trainer.batch.micro_batch_size": ["auto", 1, 2, 8, 64, 1000],
    "trainer.batch.max_tokens_per_micro_batch": [None, 64, 8192],
    "trainer.batch.packing": [None, True, False],
    "trainer.parallel.strategy": enum_values("ParallelSettings", "strategy"),
    "trainer.parallel.offload_optimizer": [True, False],
    "trainer.parallel.offload_reference": [True, False],
    "trainer.checkpoint.dir": [
        None,
        "runs/checkpoints",
        "/mnt/shared/ckpt",
        "s3://bucket/ckpt",
        "gs://bucket/ckpt",
        "az://container/ckpt",
        "s3:/bucket/x",
        "s3://",
    ],
    "trainer.logging.dir": ["runs", "s3://bucket/runs", "gs://bucket/runs"],
    "trainer.logging.wandb_project": [None, "proj"],
    "trainer.validation": [None, {"data": "synthetic:letters_or_digits", "every": 5}],
    "sky": [None, {"infra": "aws"}, {"infra": "gcp/us-central1"}, {"infra": "k8s"}],
    "dstack": [None, {"fleets": ["f"]}, {"backends": ["gcp"]}, {"max_price": 2.0}],
    "slurm": [
        None,
        {"partition": "gpu", "time": "01:00:00"},
        {"gpu_features": {"H100": "h100", "L4": "l4"}},
        {"exclusive": True, "gpu_flag": "gres"},
    ],
    "command": [None, ["echo hi"]],
    "resources.image": [None, "docker:nvcr.io/nvidia/pytorch:24.08-py3"],
    "resources.ports": [[], [8080]],
    "volumes": [[], [{"path": "/data", "name": "vol"}]],
    "ray.auth": enum_values("RaySettings", "auth"),
    "ray.debug": enum_values("RaySettings", "debug"),
    "ray.port": [6379, 8265],
    "trainer.data.max_prompt_length": [1, 64, 40000],
    "trainer.data.format": enum_values("DataSettings", "format"),
    "trainer.data.truncate": enum_values("DataSettings", "truncate"),
    "trainer.algo.policy_loss": enum_values("AlgorithmSettings", "policy_loss"),
    "trainer.algo.loss_agg": enum_values("AlgorithmSettings", "loss_agg"),
    "trainer.algo.baseline": enum_values("AlgorithmSettings", "baseline"),
    "trainer.algo.dual_clip": [None, 3.0],
    "trainer.algo.kl": [{"coef": 0.0}, {"coef": 0.1, "mode": "reward"}],
    "trainer.checkpoint.every": [1, 25],
    "trainer.checkpoint.keep": [1, 3],
    "sky.recovery": [None, {"strategy": "FAILOVER", "max_restarts_on_errors": 2}],
    "dstack.retry": [None, {"on_events": ["no-capacity"], "duration": "1h"}],
    "slurm.container": [
        None,
        {"runtime": "pyxis", "image": "nvcr.io/nvidia/pytorch:24.08-py3"},
        {"runtime": "docker", "image": "img"},
        {"runtime": "apptainer", "image": "img.sif"},
    ],
    "slurm.requeue": [None, {"retries": 2}],
}


def generated(seed: int) -> dict[str, Any]:
    """One recipe: a shipped one with 2 to 14 of FIELDS changed (a section the shipped one
    lacks comes only whole), and half the time some of its sizes left to `auto`."""
    rng = random.Random(seed)
    data = shipped_recipe_data(rng.choice(BASES))
    for dotted in rng.sample(sorted(FIELDS), rng.randint(2, 14)):
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.get(key) if isinstance(node.get(key), dict) else None
            if node is None:
                break
        if node is None:
            continue
        value = rng.choice(FIELDS[dotted])
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    trainer = data.get("trainer")
    if isinstance(trainer, dict) and rng.random() < 0.5:  # `auto` sizes, often, as users do
        for _, section, field in AUTO_FIELDS.values():
            if rng.random() < 0.5 and isinstance(trainer.get(section), dict):
                trainer[section][field] = "auto"
    if "groups" in data.get("resources", {}):  # groups replace nodes and accelerators
        data["resources"].pop("nodes", None)
        data["resources"].pop("accelerators", None)
    return data


def accepted(limit: int) -> list[tuple[int, dict[str, Any]]]:
    """The first `limit` generated recipes the schema accepts, with their seeds."""
    out: list[tuple[int, dict[str, Any]]] = []
    seed = 0
    while len(out) < limit:
        data = generated(seed)
        try:
            Recipe.model_validate(data)
        except ValidationError:
            pass
        else:
            out.append((seed, data))
        seed += 1
        assert seed < limit * 20, "the generator makes too few recipes the schema accepts"
    return out


def commands(path: Path) -> list[list[str]]:
    renders = [["render", str(path), "-b", name] for name in renderable()]
    return [
        ["lint", str(path)],
        ["plan", str(path)],
        *renders,
        ["launch", "--dry-run", str(path)],
        ["rehearse", "--dry-run", str(path)],
    ]


def check(result: Any, args: list[str]) -> str | None:
    """Why this run is not one of rlx's ends (None when it is)."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"{type(result.exception).__name__}: {result.exception}"
    if "Traceback" in result.output:
        return "a traceback in the output"
    if result.exit_code not in (0, 1):
        return f"exit {result.exit_code}"
    if result.exit_code == 1 and args[0] != "lint" and len(error_lines(result.output)) > 1:
        return f"{len(error_lines(result.output))} error lines"
    return None


def test_every_command_ends_in_one_line_on_any_accepted_recipe(tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"HF_HOME": str(tmp_path / "hf"), "RLX_DEBUG": "", "RLX_ACCELERATOR_GIB": ""}
    failures: list[str] = []
    ends: Counter[str] = Counter()
    for seed, data in accepted(EXAMPLES):
        path = tmp_path / f"recipe-{seed}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        for args in commands(path):
            result = runner.invoke(app, args, env=env)
            shown = " ".join(a for a in args if a != str(path))
            why = check(result, args)
            if why is not None:
                failures.append(f"seed {seed}: rlx {shown}: {why}")
            ends[f"{shown} exit {result.exit_code}"] += 1
    assert not failures, "\n".join(failures[:20])
    # the generator reaches both ends of every command, not only its refusals
    for command in ("lint", "plan", "render -b sky", "launch --dry-run", "rehearse --dry-run"):
        assert ends[f"{command} exit 0"] and ends[f"{command} exit 1"], ends


def test_a_seed_replays_its_recipe() -> None:
    assert generated(7) == generated(7) and generated(7) != generated(8)
