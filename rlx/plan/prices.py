"""What a recipe's accelerator alternatives cost an hour, per node and for the cluster, spot
and on-demand: from SkyPilot's catalog where it is on this machine
(~/.sky/catalogs/<version>/<cloud>/vms.csv, or under $SKY_RUNTIME_DIR), or from a file of
the same columns (`rlx plan --prices FILE`). Never an invented figure: an alternative no row
prices has no price, and with no price data at all the plan says how to get some.

An offer is a catalog row: an instance type that comes with the accelerators (name and
count as the recipe writes them, SkyPilot's names), its on-demand Price and SpotPrice per hour,
its Region; vCPUs and MemoryGiB, where the file has them, must meet the recipe's cpus and
memory. A row with no accelerator is a CPU machine, what prices a node that asks for none. A
row with no instance type prices a GPU apart from any machine (GCP's attachable GPUs): no
node price, so it is left out. The cheapest offer in the recipe's places wins.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.recipe import Recipe
from rlx.recipe.model import AMOUNT, NodeGroup

# SkyPilot's catalog columns (sky/catalog/common.py reads them so): what a price file needs.
COLUMNS = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice", "Region")
OPTIONAL = ("vCPUs", "MemoryGiB")
CATALOG = Path(".sky") / "catalogs"
VERSION = re.compile(r"v([0-9]+)")
CPU = "CPU"  # what a node that asks for no accelerator is priced as


def no_prices(command: str) -> str:
    """The one line said in place of any figure when there is no price data."""
    return (
        "prices: none on this machine; SkyPilot keeps its catalog in ~/.sky/catalogs once it "
        "has looked up offers (e.g. `sky show-gpus`), or name a file with its columns ("
        + ", ".join(COLUMNS)
        + f"): {command} --prices FILE"
    )


NO_PRICES = no_prices("rlx plan")


@dataclass(frozen=True)
class Offer:
    """One row: an instance type with its accelerators, where, and its hourly prices."""

    cloud: str  # the catalog's cloud folder; "" for a price file's rows
    region: str
    instance_type: str
    accelerator: str  # "" for a CPU machine
    count: float  # 0 for a CPU machine
    vcpus: float | None
    memory_gib: float | None
    price: float | None  # on-demand, dollars an hour
    spot_price: float | None

    @property
    def where(self) -> str:
        place = "/".join(part for part in (self.cloud, self.region) if part)
        return f"{self.instance_type} {place}".strip()


@dataclass(frozen=True)
class Prices:
    source: str  # what was read, for the reader
    offers: tuple[Offer, ...]


def _number(text: str | None, column: str, where: str) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise RlxError(f"{where}: {column} {text!r} is not a number; write e.g. 3.06") from None
    if value < 0:
        raise RlxError(f"{where}: {column} {text!r} is negative; prices and counts are not")
    return value


def read_offers(path: Path, cloud: str = "") -> list[Offer]:
    """The offers of one file in SkyPilot's vms.csv columns; one line for a file that is not
    one (missing columns, a value that is not a number)."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (rows.fieldnames or [])]
            if missing:
                raise RlxError(
                    f"{path}: a price file needs SkyPilot's vms.csv columns; missing "
                    f"{', '.join(missing)} (it has {', '.join(rows.fieldnames or []) or 'none'})"
                )
            return [
                offer
                for line, row in enumerate(rows, start=2)
                if (offer := _offer(row, cloud, f"{path}:{line}")) is not None
            ]
    except OSError as exc:
        raise RlxError(f"{path}: cannot read the price file ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise RlxError(f"{path}: not a CSV price file ({exc})") from None


def _offer(row: Mapping[str, str | None], cloud: str, where: str) -> Offer | None:
    instance = (row["InstanceType"] or "").strip()
    accelerator = (row["AcceleratorName"] or "").strip()
    count = _number(row["AcceleratorCount"], "AcceleratorCount", where) or 0.0
    if not instance or bool(accelerator) != bool(count):
        return None  # no machine to price, or an accelerator without a count (or the reverse)
    return Offer(
        cloud=cloud,
        region=(row["Region"] or "").strip(),
        instance_type=instance,
        accelerator=accelerator,
        count=count,
        vcpus=_number(row.get("vCPUs"), "vCPUs", where),
        memory_gib=_number(row.get("MemoryGiB"), "MemoryGiB", where),
        price=_number(row["Price"], "Price", where),
        spot_price=_number(row["SpotPrice"], "SpotPrice", where),
    )


def catalog_folder(env: Mapping[str, str]) -> Path | None:
    """The newest version of SkyPilot's catalog cache that holds a vms.csv, or None."""
    root = Path(env.get("SKY_RUNTIME_DIR") or "~").expanduser() / CATALOG
    if not root.is_dir():
        return None
    versions = [
        (int(found[1]), folder)
        for folder in root.iterdir()
        if (found := VERSION.fullmatch(folder.name)) and any(folder.glob("*/vms.csv"))
    ]
    return max(versions)[1] if versions else None


def load_prices(path: Path | None, env: Mapping[str, str] | None = None) -> Prices | None:
    """The price file when one is named, else SkyPilot's catalog here, else None."""
    if path is not None:
        return Prices(str(path), tuple(read_offers(path)))
    folder = catalog_folder(os.environ if env is None else env)
    if folder is None:
        return None
    files = sorted(folder.glob("*/vms.csv"))
    offers = [offer for file in files for offer in read_offers(file, file.parent.name)]
    clouds = ", ".join(file.parent.name for file in files)
    return Prices(f"SkyPilot's catalog in {folder} ({clouds})", tuple(offers))


# --------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class NodePrice:
    """One kind of node of an alternative: how many, with what, and its cheapest offers."""

    group: str  # "train" / "rollout" with resources.groups, else ""
    nodes: int
    accelerator: str
    on_demand: Offer | None
    spot: Offer | None

    def to_json(self) -> dict[str, Any]:
        def offer(o: Offer | None, price: float | None) -> dict[str, Any] | None:
            if o is None:
                return None
            return {"per_node": price, "instance_type": o.instance_type, "where": o.where}

        return {
            "group": self.group or None,
            "nodes": self.nodes,
            "accelerator": self.accelerator,
            "on_demand": offer(self.on_demand, self.on_demand.price if self.on_demand else None),
            "spot": offer(self.spot, self.spot.spot_price if self.spot else None),
        }


@dataclass(frozen=True)
class AlternativePrice:
    label: str
    nodes: tuple[NodePrice, ...]

    def cluster(self, spot: bool) -> float | None:
        """The whole job's hourly price; None unless every kind of node has one."""
        total = 0.0
        for node in self.nodes:
            offer = node.spot if spot else node.on_demand
            price = None if offer is None else offer.spot_price if spot else offer.price
            if price is None:
                return None
            total += node.nodes * price
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "alternative": self.label,
            "nodes": [node.to_json() for node in self.nodes],
            "cluster_on_demand": self.cluster(spot=False),
            "cluster_spot": self.cluster(spot=True),
        }


def _at_least(amount: str | None, have: float | None) -> bool:
    """Whether `have` meets a recipe amount ('8' exactly, '8+' at least); unknown passes."""
    if amount is None or have is None:
        return True
    found = AMOUNT.fullmatch(amount)
    if found is None:
        return True
    wanted = float(found["value"])
    return have >= wanted if found["plus"] else have == wanted


def _in_places(offer: Offer, places: list[str]) -> bool:
    if not places:
        return True
    for place in places:
        cloud, _, rest = place.lower().partition("/")
        region = rest.partition("/")[0]
        if offer.cloud and cloud != offer.cloud.lower():
            continue
        if region and region != offer.region.lower():
            continue
        return True
    return False


def _cheapest(offers: Iterable[Offer], spot: bool) -> Offer | None:
    priced = [o for o in offers if (o.spot_price if spot else o.price) is not None]
    return min(priced, key=lambda o: (o.spot_price if spot else o.price, o.where), default=None)


def node_price(prices: Prices, group: str, shape: NodeGroup, places: list[str]) -> NodePrice:
    """The cheapest offers for one kind of node: its accelerators, or a CPU machine when it
    asks for none."""
    options = shape.accelerator_options
    name, count = (options[0].type.lower(), options[0].count) if options else ("", 0)
    fitting = [
        o
        for o in prices.offers
        if o.accelerator.lower() == name
        and o.count == count
        and _at_least(shape.cpus, o.vcpus)
        and _at_least(shape.memory, o.memory_gib)
        and _in_places(o, places)
    ]
    return NodePrice(
        group,
        shape.nodes,
        str(options[0]) if options else CPU,
        _cheapest(fitting, spot=False),
        _cheapest(fitting, spot=True),
    )


def price_alternatives(recipe: Recipe, prices: Prices) -> list[AlternativePrice]:
    """An hourly price for every accelerator alternative of the recipe, the first preference
    first (a recipe of CPU nodes: one, its CPU machines)."""
    out = []
    for label, alternative in recipe.alternatives():
        res = alternative.resources
        kinds = res.node_groups() or [("", res.group("train"))]
        nodes = tuple(node_price(prices, name, shape, recipe.places) for name, shape in kinds)
        out.append(AlternativePrice(label, nodes))
    return out


def cheaper_choice(
    recipe: Recipe, priced: list[AlternativePrice], fitting: set[str], source: str
) -> str | None:
    """When the recipe lists its accelerators in order of preference and an alternative
    that fits (`fitting`: labels) costs less an hour than the first, a line that says which
    and by how much: spot prices for a spot-only recipe, else on-demand. None when the first
    is the cheapest that fits, when either side has no price, or when the alternatives are a
    set (no preference: the backend picks). What lint warns and `rlx plan` says."""
    kinds = recipe.resources.node_groups() or [("", recipe.resources.group("train"))]
    if len(priced) < 2 or not all(
        shape.accelerators_ordered for _, shape in kinds if len(shape.accelerator_options) > 1
    ):
        return None
    spot = recipe.resources.spot is True
    first, kind = priced[0], "spot" if spot else "on-demand"
    first_price = first.cluster(spot=spot)
    if first_price is None:
        return None
    others = [
        (price, p.label)
        for p in priced[1:]
        if p.label in fitting and (price := p.cluster(spot=spot)) is not None
    ]
    if not others:
        return None
    price, label = min(others)
    if price >= first_price:
        return None
    return (
        f"{label} fits too and costs ${price:,.2f} an hour {kind} for the cluster, against "
        f"${first_price:,.2f} for the first preference {first.label} (prices from {source}); "
        f"list {label} first if the cheaper one will do"
    )
