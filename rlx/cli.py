"""The `rlx` command line.

Heavy libraries (torch, ray, sky, dstack, transformers, vllm) and even the recipe model are
imported inside the commands that need them, so `rlx --help` stays instant. Expected errors
(RlxError) become one red line on stderr and exit code 1 (75 where running the job again may
succeed); RLX_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from rlx import __version__, launchers
from rlx.launchers.spec import LAUNCH_OPTIONS, BackendSpec
from rlx.node import env as node_env

if TYPE_CHECKING:
    from rlx.launchers.base import Job, JobStatus, LaunchRequest
    from rlx.recipe import Recipe

app = typer.Typer(
    name="rlx",
    help="One recipe for multi-node RL post-training (PPO/GRPO) of language models on "
    "SkyPilot, dstack, Slurm or this machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def _choices(name: str, values: list[str]) -> type[Enum]:
    """An Enum of str values for typer's choices (the backends come from their tables)."""
    return Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]


# The backends' own tables name them: rlx.launchers (launch, render) and rlx.node.env (the
# environments a node reads). Both are light to import.
Backend = _choices("Backend", list(launchers.BACKENDS))
RenderBackend = _choices("RenderBackend", launchers.renderable())
NodeBackend = _choices("NodeBackend", ["auto", *node_env.READERS])


class LintFormat(str, Enum):
    text = "text"
    github = "github"


def _either(names: Iterable[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    items = list(names)
    return " or ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)


def _takers(option: str) -> str:
    """The backends that take a launch option, for its help: 'sky, dstack'."""
    return ", ".join(b.name for b in launchers.taking(option))


def fail(message: str) -> None:
    """Print one red error line to stderr and exit 1."""
    print_error(message)
    raise typer.Exit(1)


def expected_errors(func: F) -> F:
    """Turn the errors a user can fix into one line and exit 1 (tracebacks with RLX_DEBUG=1)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from rlx.errors import RlxError

        try:
            return func(*args, **kwargs)
        except RlxError as exc:
            if os.environ.get("RLX_DEBUG"):
                raise
            print_error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def print_error(message: str) -> None:
    """The first line in red after 'error:'; any further lines (detail) plain."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    first, *rest = message.splitlines() or [""]
    console.print(f"[bold red]error:[/] {escape(first)}")
    for line in rest:
        console.print(escape(line))


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"rlx {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", callback=version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """rlx: render, lint, launch and train."""


# --------------------------------------------------------------------------- lint / render


@app.command()
@expected_errors
def lint(
    paths: list[Path] = typer.Argument(..., help="Recipe files or folders of recipes."),
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    output_format: LintFormat = typer.Option(
        LintFormat.text, "--format", help="text, or github for GitHub Actions annotations."
    ),
    prices: Path | None = typer.Option(
        None,
        "--prices",
        help="Warn when an accelerator alternative that fits costs less an hour than the "
        "first preference, with prices from this CSV file in the columns of SkyPilot's "
        "vms.csv (default: SkyPilot's catalog in ~/.sky/catalogs where it is; else no cost "
        "check).",
    ),
) -> None:
    """Check recipes before anyone pays for a GPU: schema, then semantic checks.

    One line per finding, `path:line: severity: field: message`. Exit 1 on any error (and on
    warnings with --strict)."""
    from rlx.lint import lint_file, recipe_files
    from rlx.lint.prices import cheaper_check
    from rlx.plan.prices import load_prices

    files = recipe_files(paths)
    if not files:
        fail(f"no recipe files (*.yaml, *.yml) under {', '.join(map(str, paths))}")
    price_data = load_prices(prices)
    extra = [] if price_data is None else [cheaper_check(price_data)]
    errors = warnings = 0
    for file in files:
        for finding in lint_file(file, extra):
            if finding.severity == "error":
                errors += 1
            else:
                warnings += 1
            if output_format is LintFormat.github:
                level = "error" if finding.severity == "error" else "warning"
                message = finding.message.replace("%", "%25").replace("\n", "%0A")
                typer.echo(
                    f"::{level} file={finding.file},line={finding.line},"
                    f"title={finding.field}::{message}"
                )
            else:
                typer.echo(finding.format())
    summary = f"{len(files)} recipe(s): {errors} error(s), {warnings} warning(s)"
    sys.stdout.flush()
    typer.echo(summary, err=True)
    if errors or (strict and warnings):
        raise typer.Exit(1)


@app.command()
@expected_errors
def render(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    backend: RenderBackend = typer.Option(..., "--backend", "-b", help="Target backend."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write here, not stdout."),
    force: bool = typer.Option(False, "--force", help="Render even if lint finds errors."),
) -> None:
    """Render a recipe into the backend's native file (SkyPilot YAML, dstack YAML, sbatch)."""
    from rlx.lint import lint_loaded
    from rlx.recipe import load_recipe

    loaded = _load_checked(recipe, force, lint_loaded, load_recipe)
    text = launchers.render(backend.value, loaded.recipe, str(recipe))
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        if launchers.spec(backend.value).executable:
            output.chmod(0o755)
        typer.echo(f"wrote {output}", err=True)


def _load_checked(
    path: Path,
    force: bool,
    lint_loaded: Callable[..., Any],
    load_recipe: Callable[..., Any],
    keep: bool = False,
) -> Any:
    from rlx.errors import RecipeError

    try:
        loaded = load_recipe(path)
    except RecipeError as exc:
        for finding in exc.findings:
            typer.echo(finding.format(), err=True)
        fail(f"{path} has {len(exc.findings)} error(s); fix them (see `rlx lint {path}`)")
    findings = lint_loaded(loaded)
    if keep:  # a kept cluster runs no trainer: a recipe without one is fine
        findings = [f for f in findings if not f.message.startswith("nothing to run")]
    errors = [f for f in findings if f.severity == "error"]
    for finding in findings:
        typer.echo(finding.format(), err=True)
    if errors and not force:
        fail(f"{path} has {len(errors)} lint error(s); fix them or pass --force")
    return loaded


# `rlx plan`, `rlx status` and `rlx launch`: where hourly prices come from.
PRICES_OPTION = typer.Option(
    None,
    "--prices",
    help="Hourly prices from this CSV file, in the columns of SkyPilot's vms.csv "
    "(default: SkyPilot's catalog in ~/.sky/catalogs where it is).",
)


@app.command()
@expected_errors
def plan(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    prices: Path | None = PRICES_OPTION,
) -> None:
    """Memory per GPU and per node (weights, grads, optimiser, reference, critic,
    activations, logits, rollout engine), checkpoint size, and whether it fits; with
    accelerator alternatives, a row for each and the preferred one's plan; the hourly price
    of each alternative, per node and for the cluster, spot and on-demand, where prices are
    known. Exit 1 when one does not fit."""
    import json

    from rlx.errors import RecipeError
    from rlx.plan.planner import plan_alternatives
    from rlx.plan.prices import NO_PRICES, cheaper_choice, load_prices, price_alternatives
    from rlx.plan.report import print_alternatives, print_plan, print_prices
    from rlx.recipe import load_recipe

    try:
        loaded = load_recipe(recipe)
    except RecipeError as exc:
        for finding in exc.findings:
            typer.echo(finding.format(), err=True)
        fail(f"{recipe} has {len(exc.findings)} error(s); fix them (see `rlx lint {recipe}`)")
    price_data = load_prices(prices)  # a bad price file is one line before any plan
    alternatives = plan_alternatives(loaded.recipe)
    preferred = alternatives[0]
    if preferred.plan is None:
        fail(f"{recipe}: resources.accelerators: {preferred.error}")
    result = preferred.plan
    several = len(alternatives) > 1
    priced = None if price_data is None else price_alternatives(loaded.recipe, price_data)
    on_gpus = loaded.recipe.resources.total_gpus > 0
    cheaper = None
    if priced is not None and price_data is not None:
        fitting = {a.label for a in alternatives if a.fits}
        cheaper = cheaper_choice(loaded.recipe, priced, fitting, price_data.source)
    if as_json:
        out = result.to_json()
        if several:
            out["alternatives"] = [a.to_json() for a in alternatives]
        if on_gpus:
            out["prices"] = (
                {"missing": NO_PRICES}
                if priced is None or price_data is None
                else {
                    "source": price_data.source,
                    "alternatives": [p.to_json() for p in priced],
                    "cheaper": cheaper,
                }
            )
        typer.echo(json.dumps(out, indent=2))
    else:
        if several:
            print_alternatives(alternatives)
        print_plan(result)
        if on_gpus:
            print_prices(priced, price_data.source if price_data else "", cheaper)
    if not all(a.fits for a in alternatives):
        raise typer.Exit(1)


@app.command()
def schema() -> None:
    """Print the recipe's JSON Schema (for editor completion and validation)."""
    import json

    from rlx.recipe import Recipe

    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))


# --------------------------------------------------------------------------- launch and operate


@app.command()
@expected_errors
def launch(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    backend: Backend = typer.Option(launchers.DEFAULT, "--backend", "-b", help="Where to run."),
    name: str | None = typer.Option(None, "--name", "-n", help="Job name (default: recipe's)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be submitted."),
    managed: bool = typer.Option(
        False, "--managed", help=f"{_takers('managed')}: a managed job (recovers from preemption)."
    ),
    address: str | None = typer.Option(
        None,
        "--address",
        help=f"{_takers('address')}: the cluster's dashboard, e.g. http://127.0.0.1:8265 "
        "(default: $RAY_ADDRESS).",
    ),
    detach: bool = typer.Option(
        False,
        "--detach",
        help=f"{_takers('detach')}: submit and return instead of following the job to its end.",
    ),
    keep: bool = typer.Option(
        False,
        "--keep",
        help=f"{_takers('keep')}: form the cluster and keep it with no trainer, for `-b ray` "
        "jobs and `rlx attach`; `rlx down NAME` ends it.",
    ),
    prices: Path | None = PRICES_OPTION,
) -> None:
    """Submit a recipe to a backend (default: run it here) and remember the job. Where hourly
    prices are known, the job carries its price: the run's summary and result.json give
    its cost."""
    import time

    from rlx.launchers.base import LaunchRequest, collect_secrets, remember
    from rlx.lint import lint_loaded
    from rlx.recipe import load_recipe

    loaded = _load_checked(recipe, False, lint_loaded, load_recipe, keep=keep)
    job_recipe = _renamed(loaded.recipe, name)
    chosen = launchers.spec(backend.value)
    given = {"managed": managed, "address": address is not None, "detach": detach, "keep": keep}
    _refuse_options_not_taken(chosen, given)
    if keep:
        from rlx.launchers.keep import kept_recipe

        job_recipe = kept_recipe(job_recipe)
    job_recipe = _priced(job_recipe, prices, time.time())
    text = launchers.render(backend.value, job_recipe, str(recipe))
    if dry_run:  # the native file, or what would run here
        typer.echo(text, nl=False)
        # on stderr, so that stdout stays the file the backend reads
        for line in launchers.alternatives(backend.value, job_recipe):
            typer.echo(line, err=True)
        return
    if chosen.stays_up:  # where no rendered file says what is left up afterwards
        typer.echo(f"rlx: {chosen.stays_up}", err=True)
    rendered = text if chosen.renders else ""
    request = LaunchRequest(
        recipe=job_recipe,
        source=str(recipe),
        name=job_recipe.name,
        rendered=rendered,
        secrets=collect_secrets(job_recipe, os.environ),
        workdir=Path.cwd(),
        managed=managed,
        address=address,
        detach=detach,
        keep=keep,
    )
    job = launchers.operations(backend.value).launch(request)
    if "exit_code" in job.extra:  # followed to its end here
        job.ended_at = time.time()
    remember(job, Path.cwd())
    code = int(job.extra.get("exit_code", "0"))
    _after_launch(job, request)
    raise typer.Exit(code)


def _priced(recipe: Recipe, prices: Path | None, now: float) -> Recipe:
    """The recipe carrying its cluster's hourly price (rlx.launchers.bill.priced_recipe) where
    prices are known (a bad price file: one line before anything launches), else as it is."""
    from rlx.launchers.bill import hourly_rate, priced_recipe
    from rlx.plan.prices import load_prices

    price_data = load_prices(prices)
    rate = None if price_data is None else hourly_rate(recipe, price_data)
    return recipe if rate is None else priced_recipe(recipe, rate, now)


def _after_launch(job: Job, request: LaunchRequest) -> None:
    """A kept cluster announced; a job not run to its end here, how to follow it."""
    if request.keep:
        from rlx.launchers.keep import announce

        announce(job, request.recipe, request.secrets, Path.cwd())
    elif "exit_code" not in job.extra:  # not run to its end here: say how to follow it
        typer.echo(
            f"launched {job.name} on {job.backend} ({job.handle}); follow it with: "
            f"rlx logs {job.name} --follow",
            err=True,
        )


def _renamed(recipe: Recipe, name: str | None) -> Recipe:
    """The recipe under --name, when given (refused unless it is a recipe name)."""
    from rlx.recipe.model import RECIPE_NAME

    if name is None:
        return recipe
    if not RECIPE_NAME.fullmatch(name):
        fail(
            f"--name {name!r}: use lowercase letters, digits and '-', start with a letter, "
            "2 to 40 characters"
        )
    return recipe.model_copy(update={"name": name})


def _refuse_options_not_taken(chosen: BackendSpec, given: dict[str, bool]) -> None:
    """Fail for the first option given that the chosen backend does not take, naming the
    backends that do."""
    for option in [name for name, on in given.items() if on and not chosen.takes(name)]:
        takers = launchers.taking(option)
        fail(
            f"--{option} is for {LAUNCH_OPTIONS[option]} on {_either(b.title for b in takers)}; "
            f"use it with --backend {_either(b.name for b in takers)}"
        )


@app.command()
@expected_errors
def status(
    name: str | None = typer.Argument(None, help="Job name (default: all)."),
    prices: Path | None = PRICES_OPTION,
) -> None:
    """Show the state of launched jobs: whether each is still up (billed), the hours it has
    been up, and, where prices are known, its hourly price and the spend so far."""
    import time

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Column, Table

    from rlx.launchers.base import recall, recall_all
    from rlx.launchers.bill import job_bill
    from rlx.plan.prices import load_prices, no_prices

    jobs = [recall(name, Path.cwd())] if name else recall_all(Path.cwd())
    if not jobs:
        typer.echo("no jobs launched from this folder yet (rlx launch RECIPE)", err=True)
        return
    price_data = load_prices(prices)
    now = time.time()
    rows = []
    for job in jobs:
        found, detail = _job_status(job, one=name is not None)
        bill = job_bill(job, found, price_data, now)
        state = found.state if found is not None else "UNKNOWN"
        rows.append((job.name, job.backend, job.handle, state, *bill.cells(), escape(detail)))
    headers = ("name", "backend", "id", "state", "up", "hours", "$/hour", "spend")
    # Names, states and figures are never cut or folded (a narrow terminal wraps the detail
    # alone); read through a pipe, every row is one whole line.
    columns = [
        Column(header, no_wrap=True, min_width=max(len(header), *(len(r[i]) for r in rows)))
        for i, header in enumerate(headers)
    ]
    table = Table(*columns, "detail")
    for row in rows:
        table.add_row(*row)
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console = Console(soft_wrap=True, width=1000)
    console.print(table)
    if price_data is None:
        typer.echo(no_prices("rlx status"))


def _job_status(job: Job, one: bool) -> tuple[JobStatus | None, str]:
    """A job's status and its detail; with several jobs, a backend that cannot say is a
    row (no status, the error as its detail), not the end of the table."""
    from rlx.errors import RlxError

    try:
        found = launchers.operations(job.backend).status(job)
    except RlxError as exc:
        if one:
            raise
        return None, f"status unknown: {exc}"
    return found, found.detail


@app.command()
@expected_errors
def logs(
    name: str = typer.Argument(..., help="Job name."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    node: int | None = typer.Option(None, "--node", help="Only this node (0 is the head)."),
) -> None:
    """Print a job's logs (the head's by default where the backend keeps them apart)."""
    from rlx.launchers.base import recall

    job = recall(name, Path.cwd())
    raise typer.Exit(launchers.operations(job.backend).logs(job, follow=follow, node=node))


@app.command()
@expected_errors
def down(
    name: str | None = typer.Argument(None, help="Job name."),
    every: bool = typer.Option(
        False, "--all", help="Every job launched from this folder that is still up."
    ),
) -> None:
    """Stop a job and release what it holds; with --all, every job from this folder that is
    still up (one line each; exit 1 naming those that did not stop)."""
    from rlx.launchers.base import recall

    if name is not None and every:
        fail("rlx down takes a job NAME or --all, not both")
    if name is None and not every:
        fail("rlx down needs a job NAME, or --all for every job from this folder still up")
    if name is not None:
        job = recall(name, Path.cwd())
        launchers.operations(job.backend).down(job)
        _ended(job)
        typer.echo(f"stopped {name}", err=True)
        return
    _down_all()


def _ended(job: Job) -> None:
    """Record when rlx took the job down (what `rlx status` counts its hours to)."""
    import time

    from rlx.launchers.base import remember

    job.ended_at = time.time()
    remember(job, Path.cwd())


def _down_all() -> None:
    from rlx.errors import RlxError
    from rlx.launchers.base import recall_all

    jobs = recall_all(Path.cwd())
    failed, stopped = [], 0
    for job in jobs:
        ops = launchers.operations(job.backend)
        try:
            up = ops.status(job).is_up
        except RlxError as exc:
            typer.echo(f"did not stop {job.name}: cannot tell whether it is up: {exc}", err=True)
            failed.append(job.name)
            continue
        if not up:
            continue
        try:
            ops.down(job)
        except RlxError as exc:
            typer.echo(f"did not stop {job.name}: {exc}", err=True)
            failed.append(job.name)
            continue
        _ended(job)
        stopped += 1
        typer.echo(f"stopped {job.name}", err=True)
    if failed:
        fail(f"{len(failed)} job(s) did not stop: {', '.join(failed)} (see above; rlx status)")
    if not stopped:
        typer.echo(f"nothing up among the {len(jobs)} job(s) launched from this folder", err=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@expected_errors
def attach(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Job name (a running Slurm job)."),
    node: int = typer.Option(0, "--node", help="Node index (0 is the head)."),
) -> None:
    """A shell on the head (or node K) of a running Slurm job, inside its container, with
    RAY_ADDRESS and the job's token set; `rlx attach NAME -- COMMAND` runs COMMAND there."""
    from rlx.launchers.base import recall

    job = recall(name, Path.cwd())
    if not launchers.spec(job.backend).can_attach:
        able = _either(b.title for b in launchers.specs() if b.can_attach)
        fail(f"rlx attach is for {able} jobs; {name} runs on {job.backend} (use its own ssh)")
    raise typer.Exit(launchers.operations(job.backend).attach(job, node, list(ctx.args)))


@app.command()
@expected_errors
def tunnel(
    name: str = typer.Argument(..., help="Job name."),
    port: int = typer.Option(8265, "--port", help="Local port (127.0.0.1) to forward."),
) -> None:
    """Bring a job's Ray dashboard to 127.0.0.1:PORT here (Slurm: through srun; SkyPilot
    and dstack: prints the ssh -L command)."""
    from rlx.launchers.base import recall
    from rlx.launchers.keep import tunnel_command

    job = recall(name, Path.cwd())
    if launchers.spec(job.backend).forwards:
        launchers.operations(job.backend).tunnel(job, port)
        return
    recipe = job.launched_recipe()
    if recipe is None:  # a record of an older rlx: the recipe file as it is now
        from rlx.recipe import load_recipe

        recipe = load_recipe(Path(job.source)).recipe
    command = tunnel_command(job, recipe, port)
    if command is None:
        fail(f"{name} runs on {job.backend}: there is no remote dashboard to forward")
    typer.echo(command)


# --------------------------------------------------------------------------- on the nodes


@app.command()
@expected_errors
def node(
    backend: NodeBackend = typer.Option(
        NodeBackend.auto, "--backend", "-b", help="Whose environment to read (auto: detect)."
    ),
    recipe: Path | None = typer.Option(
        None, "--recipe", help="Recipe file (default: the recipe in $RLX_RECIPE_JSON)."
    ),
) -> None:
    """Run on every node of a job: form the Ray cluster, run the trainer on the head, exit
    with its code. Rendered run blocks call this."""
    from rlx.node import bootstrap
    from rlx.node.version import check_node_version

    check_node_version(os.environ)
    loaded = _recipe_from(recipe)
    info = node_env.job_node_info(backend.value, os.environ, loaded.resources)
    raise typer.Exit(bootstrap.main(loaded, info, os.environ))


@app.command()
@expected_errors
def hold() -> None:
    """What the head of a kept cluster (`rlx launch --keep`) runs: holds it while Ray jobs run
    or wait on it, and ends once none has for resources.idle_minutes (recipe from
    $RLX_RECIPE_JSON)."""
    from rlx.node.hold import main as hold_main

    raise typer.Exit(hold_main(_recipe_from(None), os.environ))


@app.command()
@expected_errors
def train(
    recipe: Path | None = typer.Argument(
        None, help="Recipe file (default: the recipe in $RLX_RECIPE_JSON, as on a job's head)."
    ),
) -> None:
    """Run the PPO/GRPO trainer of a recipe here: against $RAY_ADDRESS when set (a job's
    head node), else on a private Ray on this machine. Resumes from the newest checkpoint
    of the run when there is one."""
    from rlx.trainer.main import main as train_main

    raise typer.Exit(train_main(_recipe_from(recipe)))


@app.command()
@expected_errors
def rehearse(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print what the rehearsal changes and stop."
    ),
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Resume from the checkpoint and train step 3."
    ),
) -> None:
    """A dress rehearsal of a recipe on this machine before any GPU is paid for: the job as
    written (layout, strategy, engines, node groups, staleness, storage, checkpoints, the
    weight push and its probe) with a small stand-in of its model served under its hub id,
    and stand-in GPUs on Ray nodes here (compute on CPU). Trains steps 1-2, checkpoints,
    resumes and trains step 3 (--no-resume: stops at the checkpoint); exit 1 if any of it
    fails."""
    from rlx.recipe import load_recipe
    from rlx.trainer.rehearsal import change_lines, plan_rehearsal, rehearse, report_lines

    loaded = load_recipe(recipe).recipe
    for line in change_lines(plan_rehearsal(loaded)):
        typer.echo(line)
    if dry_run:
        return
    result = rehearse(loaded, resume=resume)
    for line in report_lines(result, str(recipe)):
        typer.echo(line)
    if not result.passed:
        fail(f"the rehearsal of {recipe} failed: {_first_failure(result)}")


def _first_failure(result: Any) -> str:
    for run in result.runs:
        if run.error:
            return run.error
    return "a run did not reach its step (see above)"


@app.command()
@expected_errors
def export(
    checkpoint: str = typer.Argument(
        ..., help="A checkpoint's step-NNNNNN folder, or its s3:// gs:// az:// prefix."
    ),
    out: str = typer.Argument(
        ..., help="The Hugging Face folder (or store prefix) to write (must not exist)."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="A LoRA run's adapter merged into its base: a whole model."
    ),
) -> None:
    """Write a checkpoint's policy as a Hugging Face folder (config, safetensors, tokenizer,
    generation config) that from_pretrained loads and vLLM serves; a LoRA run's adapter in
    PEFT's format (PeftModel.from_pretrained, vLLM's --lora-modules), or with --merge merged
    into its base. Offline, one process."""
    from rlx.storage import location
    from rlx.trainer.checkpoint.export import export_checkpoint

    exported = export_checkpoint(
        location(checkpoint, "checkpoint"), location(out, "out"), merge=merge
    )
    typer.echo(
        f"exported {checkpoint} to {exported.folder}: {exported.tensors} tensors in "
        f"{exported.files} safetensors file(s), {exported.dtype}, "
        f"{exported.bytes / 2**20:.1f} MiB"
    )


class EvalEngine(str, Enum):
    hf = "hf"
    vllm = "vllm"


@app.command(name="eval")
@expected_errors
def eval_command(
    target: str = typer.Argument(
        ...,
        help="What to evaluate: a recipe (its newest checkpoint; --step N), a checkpoint's "
        "step-NNNNNN folder or store prefix (LoRA too), an exported Hugging Face folder, or a "
        "hub id (from the hub cache).",
    ),
    data: list[str] = typer.Option(
        [],
        "--data",
        help="A prompt file (.jsonl or .parquet; repeat for several); default: "
        "the recipe's validation data, else its training data.",
    ),
    reward: str | None = typer.Option(
        None,
        "--reward",
        help="As a recipe's trainer.reward.function (default: the recipe's, else gsm8k).",
    ),
    n: int | None = typer.Option(
        None, "--n", help="Samples per prompt (default: the recipe's validation.n, else 4)."
    ),
    temperature: float | None = typer.Option(
        None, "--temperature", help="0 is greedy (default: the recipe's, else 1.0)."
    ),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus mass (default 1.0)."),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="Longest response (default: the recipe's, else 256)."
    ),
    engine: EvalEngine = typer.Option(EvalEngine.hf, "--engine", help="Rollout engine."),
    tp: int = typer.Option(1, "--tp", help="GPUs (or CPU workers) per vLLM engine."),
    pass_threshold: float | None = typer.Option(
        None,
        "--pass-threshold",
        help="A sample is correct when its reward is at least this (default: the recipe's "
        "validation.pass_threshold, else 1.0).",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Write samples.jsonl and summary.json into this folder."
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="Sampling seed (default: the recipe's, else 0)."
    ),
    step: int | None = typer.Option(
        None, "--step", help="A recipe's checkpoint of this step (0: the model it starts from)."
    ),
) -> None:
    """Sample n responses per prompt here with rlx's own engines, score them with a reward,
    and print pass@k (unbiased, k = 1, 2, 4, ... <= n), avg@n (mean reward), maj@n (where
    the reward compares answers) and the mean response length, per data set."""
    from rlx.trainer.evaluate import EvalOptions, evaluate, print_table

    options = EvalOptions(
        data=data,
        reward=reward,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        engine=engine.value,
        tp=tp,
        pass_threshold=pass_threshold,
        out=out,
        seed=seed,
        step=step,
    )
    report = evaluate(target, options)
    print_table(report)
    if out is not None:
        typer.echo(f"wrote {out}", err=True)


class DataTask(str, Enum):
    gsm8k = "gsm8k"
    math500 = "math500"
    aime = "aime"


@app.command()
@expected_errors
def data(
    task: DataTask = typer.Argument(..., help="The benchmark to convert: gsm8k, math500, aime."),
    source: str = typer.Argument(
        ...,
        help="The benchmark's own file (jsonl or parquet: openai/gsm8k's main train or test, "
        "HuggingFaceH4/MATH-500's test, an AIME set's), or its dataset by id "
        "(hf://ORG/NAME[@revision], from the hub cache).",
    ),
    out: str = typer.Argument(..., help="The prompt file to write: .jsonl or .parquet."),
    tools: bool = typer.Option(
        False, "--tools", help="Prompts that teach the calculator tool (gsm8k-tools.yaml)."
    ),
    split: str | None = typer.Option(
        None,
        "--split",
        help="A dataset id's split (default: gsm8k train, math500 test, aime train).",
    ),
    config: str | None = typer.Option(
        None, "--config", help="A dataset id's configuration (gsm8k: main)."
    ),
) -> None:
    """Write a prompt file a recipe or `rlx eval --data` reads (prompt as chat messages,
    answer) from a benchmark as published, on this machine."""
    from rlx.trainer.tasks.benchmarks import write_prompts

    written = write_prompts(task.value, source, out, tools=tools, split=split, config=config)
    typer.echo(f"wrote {written.rows} {task.value} prompts from {written.source} to {written.path}")


def _recipe_from(path: Path | None) -> Any:
    """The recipe from a file, or from $RLX_RECIPE_JSON on a node."""
    from rlx.node.env import recipe_from_env
    from rlx.recipe import load_recipe

    if path is not None:
        return load_recipe(path).recipe
    return recipe_from_env(os.environ)


def main() -> None:
    app(prog_name="rlx")


if __name__ == "__main__":
    sys.exit(main())
