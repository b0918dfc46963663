"""The plan as people read it (a rich table per budget) and as programs read it (JSON)."""

from __future__ import annotations

from typing import Any

from rlx.plan.budget import GIB, HEADROOM, Budget
from rlx.plan.planner import AlternativePlan, MemoryPlan
from rlx.plan.prices import NO_PRICES, AlternativePrice, Offer


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n >= 2**20 else f"{n / 2**20:.2f}"


def verdict(plan: MemoryPlan) -> str:
    """One line: fits (with the tightest headroom), fits tightly, or does not fit."""
    if not plan.fits:
        return "does not fit: " + plan.problems[0]
    spare = [b.headroom for b in [*plan.gpus, *plan.hosts] if b.headroom is not None]
    if not spare:
        return "fits (no memory limits given to check against)"
    tightest = min(spare)
    if tightest < HEADROOM:
        return f"fits, but with only {tightest:.0%} headroom (keep {HEADROOM:.0%})"
    return f"fits with {tightest:.0%} headroom"


def episodes_line(plan: MemoryPlan) -> str:
    """What the plan sizes an episode by (a run with an environment)."""
    turns = plan.episode_turns
    return (
        f"episodes: up to {turns} turn{'' if turns == 1 else 's'}, {plan.episode_tokens} "
        "tokens after the prompt"
    )


def generation_line(plan: MemoryPlan) -> str | None:
    """What a step generates: its samples, their length, the engines' dtype, and with
    dynamic sampling the rounds it may take (each a generate call as long as the first)."""
    g = plan.generation
    if g is None:
        return None
    line = (
        f"generation: {g.prompts} prompts x {g.n} = {g.samples:,} samples a call, up to "
        f"{g.tokens:,} tokens each, engines in {g.dtype}"
    )
    if g.rounds > 1:
        line += (
            f"; dynamic sampling: up to {g.rounds} calls a step ({g.rounds * g.samples:,} "
            f"samples, {g.rounds}x the generation time at most) to train {g.samples:,}"
        )
    return line


def lora_lines(plan: MemoryPlan) -> list[str]:
    """One line per model trained with LoRA: what is adapted, what trains, what the
    reference is and how vLLM serves it."""
    lines = []
    for label, lora in plan.lora.items():
        layers = lora["layers"]
        line = (
            f"{label} LoRA: rank {lora['rank']} (alpha {lora['alpha']:g}) on {len(layers)} "
            f"linear layers x {lora['decoder_layers']} ({', '.join(layers)}): "
            f"{lora['adapter_params']:,} adapter parameters, "
            f"{_mib(lora['adapter_bytes'])} MiB in float32"
        )
        if label == "critic":
            line += ", trained with the value head; the body is frozen"
        elif lora["reference"] == "none":
            line += "; the base is frozen; no reference (kl.coef 0)"
        else:
            line += "; the base is frozen and is the reference (adapters off): no copy"
        if "max_lora_rank" in lora:
            line += (
                f"; vLLM serves it at max_lora_rank {lora['max_lora_rank']}, "
                f"max_loras {lora['max_loras']}, and a push is the adapter"
            )
        lines.append(line)
    return lines


def _table(budget: Budget) -> Any:
    from rich.table import Table

    title = budget.title
    if budget.capacity is not None:
        title += f": {_gib(budget.peak)} of {_gib(budget.capacity)} GiB at {budget.peak_phase}"
    else:
        title += f": {_gib(budget.peak)} GiB"
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("item")
    table.add_column("GiB", justify="right")
    table.add_column("note")
    for item in budget.items:
        counted = budget.in_peak(item)
        name = item.name if counted else f"[dim]{item.name}[/]"
        table.add_row(
            name,
            _gib(item.bytes),
            item.note if counted else f"{item.note} (not in this peak)".lstrip(" "),
        )
    return table


def print_plan(plan: MemoryPlan) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    console.print(f"[bold]{plan.recipe}[/]: {plan.model}")
    console.print(
        f"{plan.accelerator or 'CPU only'}, {plan.train_ranks} training rank(s), "
        f"strategy {plan.strategy} ({plan.strategy_reason})"
    )
    if plan.sizes is not None:
        console.print(f"sizes: {plan.sizes.line()}")
    if plan.episode_turns is not None:
        console.print(episodes_line(plan))
    if (line := generation_line(plan)) is not None:
        console.print(line)
    for line in lora_lines(plan):
        console.print(line)
    for budget in [*plan.gpus, *plan.hosts]:
        console.print()
        console.print(_table(budget))
    console.print()
    console.print(
        f"checkpoint: {_gib(plan.checkpoint_bytes)} GiB each, "
        f"{_gib(plan.checkpoints_on_disk)} GiB "
        f"{'in the store' if plan.checkpoints_in_store else 'on disk'} with retention; "
        f"export {_gib(plan.export_bytes)} GiB"
        + (
            f" (the adapter; merged {_gib(plan.export_merged_bytes)} GiB)"
            if plan.export_merged_bytes
            else ""
        )
        + (
            f"; staged {_gib(plan.staging_bytes)} GiB per node before each upload"
            if plan.staging_bytes
            else ""
        )
    )
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    for problem in plan.problems[1:]:
        console.print(f"[red]also:[/] {problem}")
    colour = "green" if plan.fits and not plan.warnings else ("yellow" if plan.fits else "red")
    console.print(f"[bold {colour}]{verdict(plan)}[/]")


def _need(plan: MemoryPlan) -> str:
    """Each GPU budget's peak against its capacity: 'train 37.9/80.0, rollout 72.0/80.0'."""
    return ", ".join(
        f"{b.title.split(' ')[0].replace('training', 'train')} {_gib(b.peak)}/{_gib(b.capacity)}"
        for b in plan.gpus
    )


def alternatives_table(alternatives: list[AlternativePlan]) -> Any:
    """One row per accelerator alternative: memory per GPU (need/capacity, GiB), the sizes
    `auto` chose, whether it fits and why."""
    from rich.table import Table

    table = Table(
        title="accelerator alternatives (the first is preferred; the plan below is its)",
        title_justify="left",
        show_edge=False,
    )
    table.add_column("alternative")
    table.add_column("GiB per GPU (need/have)")
    table.add_column("sizes")
    table.add_column("fits")
    table.add_column("why")
    for alternative in alternatives:
        plan = alternative.plan
        if plan is None:
            table.add_row(alternative.label, "-", "-", "[red]unknown[/]", alternative.why())
            continue
        sizes = "-"
        if plan.sizes is not None:
            sizes = ", ".join(
                f"{name} {value:g}"
                for name, value in plan.sizes.to_json().items()
                if name in plan.sizes.auto
            )
        fits = "[green]yes[/]" if plan.fits else "[red]no[/]"
        if plan.fits and plan.warnings:
            fits = "[yellow]tight[/]"
        table.add_row(alternative.label, _need(plan), sizes, fits, alternative.why())
    return table


def print_alternatives(alternatives: list[AlternativePlan]) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    console.print(alternatives_table(alternatives))
    for alternative in alternatives[1:]:
        plan = alternative.plan
        if plan is None:
            console.print(f"[red]{alternative.label}:[/] {alternative.error}")
        elif not plan.fits:
            console.print(f"[red]{alternative.label} does not fit:[/] {plan.problems[0]}")
    console.print()


def _priced(offer: Offer | None, price: float | None, kind: str) -> str:
    if offer is None or price is None:
        return f"{kind} not priced"
    return f"${price:,.2f} {kind} ({offer.where})"


def price_lines(priced: list[AlternativePrice], source: str) -> list[str]:
    """Each alternative's hourly price for the whole cluster, then per node of each kind with
    the offer it is (instance type, place), spot and on-demand; 'not priced' where no row
    prices it."""
    lines = [f"hourly price in dollars, from {source}:"]
    for alternative in priced:
        cluster = [
            f"${total:,.2f} {kind}" if total is not None else f"{kind} not priced"
            for kind, total in (
                ("on-demand", alternative.cluster(spot=False)),
                ("spot", alternative.cluster(spot=True)),
            )
        ]
        lines.append(f"  {alternative.label}: cluster {', '.join(cluster)}")
        for node in alternative.nodes:
            group = f"{node.group} " if node.group else ""
            on_demand_price = node.on_demand.price if node.on_demand else None
            on_demand = _priced(node.on_demand, on_demand_price, "on-demand")
            spot = _priced(node.spot, node.spot.spot_price if node.spot else None, "spot")
            lines.append(
                f"    {group}{node.nodes} x {node.accelerator}, per node: {on_demand}, {spot}"
            )
    return lines


def print_prices(
    priced: list[AlternativePrice] | None, source: str, cheaper: str | None = None
) -> None:
    """The prices, or the one line that says how to get them (None: no price data); then
    the cheaper alternative that fits, when there is one (prices.cheaper_choice)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(soft_wrap=True, highlight=False)
    console.print()
    for line in [NO_PRICES] if priced is None else price_lines(priced, source):
        console.print(escape(line))
    if cheaper is not None:
        console.print(f"[yellow]cheaper:[/] {escape(cheaper)}")
