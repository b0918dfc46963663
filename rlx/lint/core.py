"""What a check is: a function from a recipe to problems, each tied to a field.

A check sees only the validated recipe (no file, no lines), so the trainer can run the same
function at start-up that lint runs before launch; lint turns each problem into a finding
that points at the field's line in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlx.recipe import Recipe
from rlx.recipe.yamlpos import Path_

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: the field concerned (its path), error or warning, and
    what is wrong and what to write instead."""

    field: Path_
    severity: str  # ERROR | WARNING
    message: str


Check = Callable[[Recipe], Iterable[Problem]]
