"""`rlx eval TARGET`: sample n responses per prompt from a model with one of rlx's own rollout
engines, score them with a reward, and report pass@k, avg@n and maj@n (tasks/passk.py).

TARGET is whatever holds a policy: a recipe (its newest checkpoint, or `--step N`; step 0 is
the model it starts from), a checkpoint's step folder or its store prefix (a LoRA run's too,
merged into its base), an exported or saved Hugging Face folder, a hub id (the hub cache), or
any model spec a recipe takes (`tiny:...`). A checkpoint is exported into a scratch folder
first by the exporter itself (checkpoint/export.py): no step for the user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.trainer.tasks.passk import PromptSamples, ks_up_to, summarize

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
RECIPE_SUFFIXES = (".yaml", ".yml")
# Without a recipe to say otherwise.
DEFAULT_N = 4
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class EvalOptions:
    """The command's options; None: the recipe's value where the target is a recipe, else
    the default."""

    data: Sequence[str] = ()
    reward: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    engine: str = "hf"
    tp: int = 1
    pass_threshold: float | None = None
    out: Path | None = None
    seed: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Target:
    """A model folder to load, what it is (for the table's title) and, from a recipe, its
    trainer settings (the data, reward and sampling it trains with)."""

    folder: str
    label: str
    settings: TrainerSettings | None = None


@dataclass(frozen=True)
class EvalReport:
    """What was evaluated, and each data set's figures."""

    label: str
    results: list[DataResult]


@dataclass(frozen=True)
class DataResult:
    """One data set's figures and samples."""

    source: str
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(repr=False)
    failures: str = ""  # the reward terms that failed on samples, and their first errors


# --------------------------------------------------------------------------- the target


def check_options(options: EvalOptions) -> None:
    """One line for the first option that cannot work, before anything loads."""
    from rlx.trainer.rollout import ENGINES, engine_class

    if options.engine not in ENGINES:
        raise RlxError(f"--engine {options.engine!r}: use {' or '.join(ENGINES)}")
    engine = engine_class(options.engine)
    if options.n is not None and options.n < 1:
        raise RlxError(f"--n {options.n}: give at least 1 sample per prompt")
    if options.temperature is not None and options.temperature < 0:
        raise RlxError(f"--temperature {options.temperature}: give 0 (greedy) or more")
    if options.top_p is not None and not 0 < options.top_p <= 1:
        raise RlxError(f"--top-p {options.top_p}: give a value in (0, 1]")
    if options.max_new_tokens is not None and options.max_new_tokens < 1:
        raise RlxError(f"--max-new-tokens {options.max_new_tokens}: give at least 1")
    if options.tp < 1:
        raise RlxError(f"--tp {options.tp}: give at least 1")
    if options.tp > 1 and not engine.splits_over_gpus:
        splitting = [name for name in ENGINES if engine_class(name).splits_over_gpus]
        raise RlxError(f"--tp {options.tp} splits a model over GPUs; add --engine {splitting[0]}")
    if options.step is not None and options.step < 0:
        raise RlxError(f"--step {options.step}: give a step number, 0 or more")
    if options.out is not None and options.out.exists() and not options.out.is_dir():
        raise RlxError(f"--out {options.out} is a file; give a folder")
    if options.reward is not None:
        from rlx.trainer.tasks.rewards import reward_spec_problem

        problem = reward_spec_problem(options.reward)
        if problem is not None:
            raise RlxError(f"--reward: {problem}")
    _check_installed(engine, options.engine)


def _check_installed(engine: Any, kind: str) -> None:
    """The engine's own check that this machine has what it needs, worded for --engine."""
    import torch

    settings: Any = SimpleNamespace(rollout=SimpleNamespace(engine=kind))
    try:
        engine.check_installed(settings, torch.cuda.is_available())
    except RlxError as exc:
        raise RlxError(f"--engine {kind}: {str(exc).partition(': ')[2]}") from None


def is_recipe(spec: str) -> bool:
    return spec.endswith(RECIPE_SUFFIXES) and Path(spec).is_file()


@contextlib.contextmanager
def resolved_target(spec: str, options: EvalOptions) -> Iterator[Target]:
    """The model folder TARGET stands for, while the command runs (a checkpoint's export
    lives in a scratch folder removed afterwards)."""
    scratch = Path(tempfile.mkdtemp(prefix="rlx-eval-"))
    try:
        yield _resolve(spec, options, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _resolve(spec: str, options: EvalOptions, scratch: Path) -> Target:
    from rlx.checkpoints import step_of
    from rlx.storage import is_store_url

    if is_recipe(spec):
        return _recipe_target(Path(spec), options.step, scratch)
    if options.step is not None:
        raise RlxError(f"--step picks a checkpoint of a recipe's run; {spec} is not a recipe")
    path = Path(spec).expanduser()
    if is_store_url(spec) and step_of(spec) is not None:
        return Target(_exported(spec, scratch), f"checkpoint {spec}")
    if path.is_dir():
        from rlx.checkpoints import MARKER

        if (path / MARKER).exists() or step_of(path.name) is not None or _has_steps(path):
            return Target(_exported(str(path), scratch), f"checkpoint {spec}")
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise RlxError(
                f"{spec} is neither a model folder (no config.json) nor a checkpoint (no "
                "COMPLETE marker); give an exported folder, a step-NNNNNN folder or a recipe"
            )
        return Target(str(path.absolute()), spec)
    if path.suffix in RECIPE_SUFFIXES or path.suffix in (".jsonl", ".parquet"):
        what = "recipe" if path.suffix in RECIPE_SUFFIXES else "model (a data file?)"
        raise RlxError(f"TARGET {spec} does not exist; give an existing {what}")
    from rlx.trainer.resolve import resolve_model_path

    try:
        return Target(resolve_model_path(spec, scratch / "models", options.seed or 0), spec)
    except RlxError as exc:
        message = str(exc).removeprefix("trainer.model.path: ")
        raise RlxError(f"TARGET: {message}") from None


def _steps(run: Path) -> str:
    from rlx.checkpoints import step_of

    steps = sorted(s for p in run.glob("step-*") if (s := step_of(p.name)) is not None)
    return ", ".join(map(str, steps)) or "none"


def _has_steps(folder: Path) -> bool:
    from rlx.checkpoints import step_of

    return any(step_of(p.name) is not None for p in folder.iterdir() if p.is_dir())


def _exported(checkpoint: str, scratch: Path) -> str:
    """A checkpoint as a Hugging Face folder in scratch: a LoRA run's adapter merged into its
    base (whole, so that either engine loads it)."""
    from rlx.storage import is_store_url, location
    from rlx.trainer.checkpoint.export import check_checkpoint, export_checkpoint
    from rlx.trainer.checkpoint.training import LORA_PART

    if is_store_url(checkpoint):
        from rlx.trainer.checkpoint.remote import read_marker_url

        marker = read_marker_url(checkpoint)
        if marker is None:
            raise RlxError(f"{checkpoint} is not a complete checkpoint (no COMPLETE marker)")
    else:
        marker = check_checkpoint(Path(checkpoint))
    lora = LORA_PART in marker["parts"]
    out = scratch / "model"
    export_checkpoint(location(checkpoint, "TARGET"), out, merge=lora)
    return str(out)


def _recipe_target(path: Path, step: int | None, scratch: Path) -> Target:
    """A recipe's checkpoint: the newest, or `step`'s; step 0 is the model the run starts
    from, built or fetched as the trainer does."""
    from rlx.checkpoints import newest_complete_step, step_name
    from rlx.recipe import load_recipe
    from rlx.storage import join
    from rlx.trainer.resolve import model_cache_dir, resolve_model_path, run_paths

    recipe = load_recipe(path).recipe
    settings = recipe.trainer
    if settings is None:
        raise RlxError(f"{path} has no trainer section: nothing to evaluate")
    paths = run_paths(recipe.name, settings, os.environ)
    if step == 0:
        folder = resolve_model_path(settings.model.path, model_cache_dir(paths), settings.seed)
        return Target(folder, f"{path} at step 0 ({settings.model.path})", settings)
    root = paths.checkpoint_root
    if root is None:
        raise RlxError(
            f"{path}: trainer.checkpoint.dir is unset, so the run keeps no checkpoint; "
            "evaluate its model with --step 0"
        )
    run = join(str(root), paths.run_id) if isinstance(root, str) else root / paths.run_id
    if step is None:
        found = newest_complete_step(run)
        if found is None:
            raise RlxError(
                f"{path}: no complete checkpoint under {run} yet; train it first (rlx launch "
                f"{path}), or evaluate its model with --step 0"
            )
    else:
        found = (
            join(str(run), step_name(step)) if isinstance(run, str) else str(run / step_name(step))
        )
        if not isinstance(run, str) and not Path(found).is_dir():
            raise RlxError(
                f"{path}: no checkpoint of step {step} under {run} (checkpoint.dir is read from "
                f"the folder you run in, as training reads it); steps there: {_steps(run)}"
            )
    label = f"{path} at {Path(str(found)).name}"
    return Target(_exported(str(found), scratch), label, settings)


# --------------------------------------------------------------------------- settings


def eval_settings(target: Target, options: EvalOptions) -> TrainerSettings:
    """The trainer settings evaluation runs under: the recipe's (or defaults) with the
    command's options over them; the model is the target's folder, whole (no adapters)."""
    data = list(options.data)
    base = target.settings
    if base is None:
        if not data:
            raise RlxError("--data: give a prompt file (.jsonl or .parquet) to evaluate on")
        raw: dict[str, Any] = {
            "model": {"path": target.folder},
            "data": {"train": data[0]},
            "rollout": {"n": DEFAULT_N, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS},
        }
        base = TrainerSettings.model_validate(raw)
    rollout = base.rollout
    validation = base.validation
    n = options.n or (validation.n if validation is not None else DEFAULT_N)
    max_new = options.max_new_tokens or (
        validation.max_new_tokens if validation and validation.max_new_tokens else None
    )
    rollout = rollout.model_copy(
        update={
            "engine": options.engine,
            "n": n,
            "max_new_tokens": max_new or rollout.max_new_tokens,
            "temperature": rollout.temperature
            if options.temperature is None
            else options.temperature,
            "top_p": rollout.top_p if options.top_p is None else options.top_p,
            "max_staleness": 0,
        }
    )
    model = base.model.model_copy(update={"path": target.folder, "lora": None})
    reward, rewards = base.reward, base.rewards  # a mix of terms: scored as validation does
    if options.reward is not None:
        reward = reward.model_copy(update={"function": options.reward, "gsm8k_mode": "strict"})
        rewards = None
    return base.model_copy(
        update={
            "model": model,
            "rollout": rollout,
            "reward": reward,
            "rewards": rewards,
            "validation": None,
            "seed": base.seed if options.seed is None else options.seed,
        }
    )


def pass_threshold(target: Target, options: EvalOptions) -> float:
    """--pass-threshold, else the recipe's validation.pass_threshold (what its validation
    counts as correct), else 1.0 (the 0/1 rewards' success)."""
    if options.pass_threshold is not None:
        return options.pass_threshold
    validation = target.settings.validation if target.settings is not None else None
    return validation.pass_threshold if validation is not None else 1.0


def data_sources(target: Target, options: EvalOptions) -> list[tuple[str, int | None]]:
    """(source, at most this many prompts): --data whole, else the recipe's held-out prompts
    as its validation takes them, else its training prompts."""
    if options.data:
        return [(source, None) for source in options.data]
    settings = target.settings
    assert settings is not None  # eval_settings asked for --data without a recipe
    if settings.validation is not None:
        return [(settings.validation.data, settings.validation.max_prompts)]
    return [(settings.data.train, None)]


# --------------------------------------------------------------------------- the run


def evaluate(spec: str, options: EvalOptions) -> EvalReport:
    """Evaluate TARGET on each data set; writes --out's files."""
    check_options(options)
    with resolved_target(spec, options) as target:
        options = dataclasses.replace(options, pass_threshold=pass_threshold(target, options))
        settings = eval_settings(target, options)
        sources = data_sources(target, options)
        with tempfile.TemporaryDirectory(prefix="rlx-eval-data-") as data_dir:
            results = _evaluate(target, settings, sources, options, Path(data_dir))
        return EvalReport(target.label, results)


def _evaluate(
    target: Target,
    settings: TrainerSettings,
    sources: list[tuple[str, int | None]],
    options: EvalOptions,
    data_dir: Path,
) -> list[DataResult]:
    from rlx.trainer.resolve import load_tokenizer, resolve_data_path
    from rlx.trainer.tasks.data import load_recipe_prompts
    from rlx.trainer.tasks.rewards import answer_extractor

    tokenizer = load_tokenizer(target.folder, settings.model.trust_remote_code)
    datasets = []
    for source, limit in sources:
        try:
            path = resolve_data_path(source, data_dir, settings.seed, "data", held_out=True)
        except RlxError as exc:
            raise RlxError(str(exc).replace("trainer.data:", "--data:")) from None
        dataset = dataclasses.replace(
            load_recipe_prompts(path, tokenizer, settings.data), source=source
        )
        datasets.append(dataset if limit is None else first_prompts(dataset, limit))
    scorer = _scorer(settings, tokenizer)
    extract = answer_extractor(settings)
    engine = _engine(settings, target.folder, options)
    results = []
    try:
        for dataset in datasets:
            results.append(
                _one_dataset(engine, dataset, tokenizer, settings, scorer, extract, options)
            )
    finally:
        engine.close()
    if options.out is not None:
        write_results(options.out, results, target.label)
    return results


class Scored:
    """Each sample's reward (NaN where a weighted term failed on it) and, where terms
    failed, which and their first error."""

    def __init__(self, rewards: list[float], failures: str = "") -> None:
        self.rewards = rewards
        self.failures = failures


def _scorer(settings: TrainerSettings, tokenizer: Any) -> Any:
    """scorer(prompts, responses, answers, inputs) -> Scored: the one reward function, which
    stops the evaluation at a sample it fails on; or a recipe's trainer.rewards, as its
    validation scores them (the terms' weighted sum; a sample a weighted term fails on is
    not correct and is left out of avg@n, and the table says how many)."""
    if settings.rewards is None:
        from rlx.trainer.resolve import resolve_reward_fn
        from rlx.trainer.tasks.rewards import score

        reward_fn = resolve_reward_fn(settings)
        return lambda prompts, responses, answers, inputs: Scored(
            score(reward_fn, prompts, responses, answers)
        )
    from rlx.trainer.tasks.reward_terms import build_terms

    terms = build_terms(settings, os.environ)
    terms.use_policy_tokenizer(tokenizer)

    def scorer(prompts: Any, responses: Any, answers: Any, inputs: Any) -> Scored:
        scored = terms.score(prompts, responses, answers, inputs)
        return Scored(scored.outcome().tolist(), scored.failure_line())

    return scorer


def first_prompts(dataset: Any, limit: int) -> Any:
    """The first `limit` prompts of a dataset."""
    return dataclasses.replace(
        dataset,
        prompts=dataset.prompts[:limit],
        prompt_token_ids=dataset.prompt_token_ids[:limit],
        answers=dataset.answers[:limit],
        row_indices=dataset.row_indices[:limit],
        columns=dataset.columns[:limit],
    )


def _engine(settings: TrainerSettings, folder: str, options: EvalOptions) -> Any:
    import torch

    from rlx.trainer.job import engine_dtype_name
    from rlx.trainer.rollout import engine_for_job

    on_gpus = torch.cuda.is_available()
    return engine_for_job(
        options.engine,
        settings,
        folder,
        dtype=engine_dtype_name(settings, on_gpus),
        device="cuda" if on_gpus else "cpu",
        use_gpu=on_gpus,
        tensor_parallel=options.tp,
    )


def _one_dataset(
    engine: Any,
    dataset: Any,
    tokenizer: Any,
    settings: TrainerSettings,
    scorer: Any,
    extract: Any,
    options: EvalOptions,
) -> DataResult:
    from rlx.trainer.report.progress import Progress
    from rlx.trainer.rollout.base import SamplingArgs
    from rlx.trainer.tasks.reward_terms import RewardInputs

    threshold = options.pass_threshold
    assert threshold is not None  # resolved by evaluate()
    rollout = settings.rollout
    n = rollout.n
    sampling = SamplingArgs(
        n, rollout.max_new_tokens, rollout.min_new_tokens, rollout.temperature, rollout.top_p
    )
    per_call = engine.prompts_per_call  # the progress bar moves once per call
    samples: list[dict[str, Any]] = []
    failures = ""
    prompts: list[PromptSamples] = []
    with Progress(len(dataset), f"eval {Path(dataset.source).name}") as progress:
        for call, start in enumerate(range(0, len(dataset), per_call)):
            rows = range(start, min(start + per_call, len(dataset)))
            batch = engine.generate(
                [dataset.prompt_token_ids[i] for i in rows], sampling, seed=settings.seed + call
            )
            responses = tokenizer.batch_decode(batch.response_lists(), skip_special_tokens=True)
            lengths = batch.response_lengths.tolist()
            texts = [dataset.prompts[i] for i in rows for _ in range(n)]
            answers = [dataset.answers[i] for i in rows for _ in range(n)]
            inputs = RewardInputs.of_rows(dataset, rows, n, batch.response_lists())
            scored = scorer(texts, responses, answers, inputs)
            rewards = scored.rewards
            failures = failures or scored.failures
            for offset, row in enumerate(rows):
                group = range(offset * n, (offset + 1) * n)
                got = [extract(responses[j]) if extract else None for j in group]
                correct = [rewards[j] >= threshold for j in group]
                prompts.append(
                    PromptSamples(
                        [rewards[j] for j in group], correct, got, [lengths[j] for j in group]
                    )
                )
                for sample, j in enumerate(group):
                    samples.append(
                        {
                            "index": row,
                            "sample": sample,
                            "prompt": dataset.prompts[row],
                            "response": responses[j],
                            "answer": dataset.answers[row],
                            "extracted": got[sample],
                            "reward": rewards[j] if math.isfinite(rewards[j]) else None,
                            "correct": correct[sample],
                            "length": lengths[j],
                        }
                    )
            progress.update(len(rows))
    metrics = summarize(prompts, compares_answers=extract is not None)
    return DataResult(dataset.source, metrics, samples, failures)


# --------------------------------------------------------------------------- output


def write_results(out: Path, results: Sequence[DataResult], label: str) -> None:
    """out/samples.jsonl and out/summary.json for one data set; with several, the same two
    files in a folder per data set (out/<file name without suffix>/)."""
    folders = [out] if len(results) == 1 else [out / _folder_name(r.source) for r in results]
    if len(set(folders)) != len(folders):
        folders = [out / f"{i}-{_folder_name(r.source)}" for i, r in enumerate(results)]
    for folder, result in zip(folders, results, strict=True):
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / SAMPLES_FILE).open("w", encoding="utf-8") as f:
            for sample in result.samples:
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        summary = {**result.metrics, "data": result.source, "target": label}
        (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _folder_name(source: str) -> str:
    return Path(source).name.split(".")[0] or "data"


def metric_columns(results: Sequence[DataResult]) -> list[str]:
    """The table's columns: every pass@k, then avg@n and maj@n, then the length."""
    names: list[str] = []
    for result in results:
        for name in result.metrics:
            if name not in names:
                names.append(name)
    order = [f"pass@{k}" for k in ks_up_to(1 << 30)]
    passes = [name for name in order if name in names]
    rest = [n for n in names if n not in passes and n != "response_length"]
    return [*passes, *rest, "response_length"]


def print_table(report: EvalReport, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(soft_wrap=True)
    columns = metric_columns(report.results)
    table = Table("data", "prompts", *columns, title=f"rlx eval: {report.label}")
    for result in report.results:
        prompts = len({s["index"] for s in result.samples})
        cells = [
            f"{result.metrics[c]:.1f}"
            if c == "response_length"
            else f"{result.metrics[c]:.4f}"
            if c in result.metrics
            else "-"
            for c in columns
        ]
        table.add_row(Path(result.source).name, str(prompts), *cells)
    console.print(table)
    for result in report.results:
        failed = sum(1 for sample in result.samples if sample["reward"] is None)
        if failed:  # not correct, and left out of avg@n
            console.print(
                f"note: {Path(result.source).name}: {failed} of {len(result.samples)} samples "
                f"have no reward ({result.failures})",
                markup=False,
                highlight=False,
            )
