"""What a launched job has cost so far: the hours it has been up and, where prices are known,
its hourly price and the spend. Pure: the clock comes in as `now`, the prices as data
(rlx.plan.prices), and nothing here asks a backend anything.

The hourly price is the cluster's, for what the job's recipe asks for: its first accelerator
alternative (the backend may have got another; the table names the one priced), spot for a
spot-only recipe, on-demand otherwise; with `spot: auto` the on-demand price, shown as an
upper bound. A job is billed from its launch (provisioning included) until it is no longer
up: until now while it is, else until the time its end was recorded, and unknown without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.launchers.base import Job, JobStatus
from rlx.plan.prices import Prices, price_alternatives
from rlx.recipe import Recipe

DASH = "-"


@dataclass(frozen=True)
class Rate:
    """A cluster's price an hour."""

    dollars: float
    label: str  # the accelerator alternative priced
    at_most: bool = False  # spot: auto: the on-demand price, what it costs at most


@dataclass(frozen=True)
class Bill:
    """One job's row: up or not (None: its backend could not say), hours up, the rate."""

    up: bool | None
    hours: float | None
    rate: Rate | None

    @property
    def spend(self) -> float | None:
        if self.hours is None or self.rate is None:
            return None
        return self.hours * self.rate.dollars

    def cells(self) -> tuple[str, str, str, str]:
        """The table's cells: up, hours, $/hour, spend; a dash for what is not known."""
        up = {True: "yes", False: "no", None: "?"}[self.up]
        hours = DASH if self.hours is None else f"{self.hours:.2f}"
        rate = DASH if self.rate is None else money(self.rate.dollars, self.rate.at_most)
        if self.rate is not None and self.rate.label:
            rate += f" ({self.rate.label})"
        at_most = self.rate is not None and self.rate.at_most
        spend = DASH if self.spend is None else money(self.spend, at_most)
        return up, hours, rate, spend


def money(dollars: float, at_most: bool = False) -> str:
    return f"{'<= ' if at_most else ''}${dollars:,.2f}"


def hourly_rate(recipe: Recipe, prices: Prices) -> Rate | None:
    """The cluster's hourly price for the recipe's first alternative; None where no offer
    prices every kind of node (or the price the recipe's spot setting asks for)."""
    priced = price_alternatives(recipe, prices)
    if not priced:
        return None
    first = priced[0]
    spot = recipe.resources.spot
    dollars = first.cluster(spot=spot is True)
    if dollars is None:
        return None
    label = first.label if len(priced) > 1 else ""  # name it where the recipe had a choice
    return Rate(dollars, label, at_most=spot == "auto")


def hours_up(
    launched_at: float, up: bool | None, ended_at: float | None, now: float
) -> float | None:
    """Hours from the launch to now while up, else to the recorded end; None when neither
    is known (not up, or could not tell, and no end recorded)."""
    if up:
        end: float | None = now
    else:
        end = ended_at
    if end is None:
        return None
    return max(0.0, end - launched_at) / 3600


def job_bill(job: Job, status: JobStatus | None, prices: Prices | None, now: float) -> Bill:
    """A job's bill from its record and its status (None: the backend could not say)."""
    up = None if status is None else status.is_up
    # the backend's own record of the end first (a local run's result.json), else rlx's
    ended = status.ended_at if status is not None else None
    ended = ended if ended is not None else job.ended_at
    hours = hours_up(job.launched_at, up, ended, now)
    recipe = job.launched_recipe()
    rate = None if prices is None or recipe is None else hourly_rate(recipe, prices)
    return Bill(up, hours, rate)


def priced_recipe(recipe: Recipe, rate: Rate, launched_at: float) -> Recipe:
    """The recipe with its price in the job's environment (rlx.runs.PRICE_ENV and the
    others), so the run's result.json and summary carry its cost."""
    from rlx.runs import LAUNCHED_AT_ENV, PRICE_AT_MOST_ENV, PRICE_ENV, PRICE_LABEL_ENV

    priced = {
        PRICE_ENV: f"{rate.dollars:.6g}",
        PRICE_LABEL_ENV: rate.label,
        PRICE_AT_MOST_ENV: "1" if rate.at_most else "0",
        LAUNCHED_AT_ENV: f"{launched_at:.3f}",
    }
    return recipe.model_copy(update={"env": {**recipe.env, **priced}})
