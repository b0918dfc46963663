"""How many times `rlx train`'s start-up plans the recipe: calls into rlx.plan's entry points
(plan_recipe, size_recipe, choose_strategy) made by the trainer, a call made inside another
one counted with it. The quickstart recipe (a tiny model, CPU) starts as `rlx train` starts
it, up to where the actors would; Ray, the watchdog, the model and the data are stood in
for, since none of them plans. A training GPU's planned peak, asked on GPU jobs once the
run is over, is asked too.

    python bench/planner_runs.py [CHECKOUT]   (default: this one)

Prints 'planner runs per start-up: N' for the recipe as shipped, and for it with
micro_batch_size: auto (whose sizing is one run of its own)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = (
    ("rlx.plan.planner", "plan_recipe"),
    ("rlx.plan.planner", "size_recipe"),
    ("rlx.plan.strategy", "choose_strategy"),
    ("rlx.trainer.device", "size_recipe"),  # imported by name there
)


class Reached(Exception):
    """Start-up got as far as the actors."""


@contextlib.contextmanager
def patched(target: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


def counting(calls: list[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    depth = [0]

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                calls.append(function.__name__)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    return wrap


def planner_runs(recipe: Any) -> list[str]:
    """The planner entry points one start-up of `recipe` calls, in order."""
    import importlib

    from rlx.trainer import main
    from rlx.trainer.actors import cluster, placement, probes

    calls: list[str] = []
    wrap = counting(calls)
    jobs: list[Any] = []

    def start(job: Any, *args: Any, **kwargs: Any) -> Any:
        jobs.append(job)
        raise Reached

    # Every module imported before any is patched: one importing a patched name would keep it.
    modules = [(importlib.import_module(module), name) for module, name in ENTRY_POINTS]
    with contextlib.ExitStack() as stack:
        for target, name in modules:
            if hasattr(target, name):
                stack.enter_context(patched(target, name, wrap(getattr(target, name))))
        stack.enter_context(patched(main, "owned_run", contextlib.nullcontext))
        stack.enter_context(patched(main, "connect_ray", lambda job, env: (False, "here")))
        stack.enter_context(patched(main, "resolve_inputs", lambda *a: (None, "model", None)))
        stack.enter_context(patched(main, "check_engine_installed", lambda job: None))
        stack.enter_context(patched(placement, "alive_nodes", lambda: []))
        stack.enter_context(patched(placement, "check_resources", lambda *a: None))
        stack.enter_context(patched(probes, "probe_nodes", lambda places, nodes: None))
        stack.enter_context(patched(cluster.Cluster, "start", staticmethod(start)))
        with contextlib.suppress(Reached):
            main.run_training(recipe, {**os.environ, "RLX_RUN_ID": "planner-runs"})
        job = dataclasses.replace(jobs[0], on_gpus=True)
        if len(inspect.signature(main.planned_gpu_gib).parameters) == 1:
            main.planned_gpu_gib(job)
        else:
            main.planned_gpu_gib(job, os.environ)
    return calls


def quickstart(root: Path, auto: bool = False) -> Any:
    from rlx.recipe.load import load_recipe

    recipe = load_recipe(root / "recipes" / "quickstart.yaml").recipe
    if auto:
        trainer = recipe.trainer
        batch = trainer.batch.model_copy(update={"micro_batch_size": "auto"})
        trainer = trainer.model_copy(update={"batch": batch})
        recipe = recipe.model_copy(update={"trainer": trainer})
    return recipe


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else ROOT
    sys.path.insert(0, str(root))
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # the recipe's run and checkpoint folders are relative
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                shipped = planner_runs(quickstart(root))
                auto = planner_runs(quickstart(root, auto=True))
        finally:
            os.chdir(here)
    print(f"planner runs per start-up: {len(shipped)} ({', '.join(shipped)})")
    print(f"planner runs per start-up, micro_batch_size auto: {len(auto)} ({', '.join(auto)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
