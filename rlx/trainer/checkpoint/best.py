"""checkpoint.best: the saved step whose validation metric is the best so far, and the one
retention rule both managers follow (a folder's, store.py; a store's, remote.py): the
newest `keep` complete steps stay, and the best step beside them.

A step is a candidate when it is both validated and saved (its value is the one measured at
that step, never an older one). The controller decides the best as it asks for a save and
hands its step to the save (SaveRequest.best_step), so rank 0's rotation spares it; the
best goes into the trainer state the checkpoint holds, so a resume knows it again. Pure
Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


def rotated_out(steps: Iterable[int], newest: int, keep: int, best: int | None) -> list[int]:
    """The complete steps a save of `newest` removes: those after it (a run that saves step
    N has abandoned what came after N: it was resumed from an earlier step), and those older
    than the newest `keep` up to it, except the best step."""
    ordered = sorted(steps)
    abandoned = [step for step in ordered if step > newest]
    current = [step for step in ordered if step <= newest]
    return abandoned + [step for step in current[:-keep] if step != best]


@dataclass(frozen=True)
class Best:
    """The best step so far by `metric` (mode 'max' or 'min') and its value."""

    metric: str
    mode: str
    step: int
    value: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> Best | None:
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls(str(raw["metric"]), str(raw["mode"]), int(raw["step"]), float(raw["value"]))
        except (KeyError, TypeError, ValueError):
            return None

    def line(self) -> str:
        """'val/avg@4 0.412 at step 6 (max)'."""
        return f"{self.metric} {self.value:.4g} at step {self.step} ({self.mode})"


def beats(value: float, best: Best | None, mode: str) -> bool:
    """Whether value is better than the best so far (a tie keeps the earlier step; a value
    that is not a number never wins)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best.value if mode == "max" else value < best.value


def consider(
    best: Best | None, setting: Any, step: int, validated: Mapping[str, float] | None
) -> Best | None:
    """The best after step's save: step itself where it was validated (`validated`: that
    step's val/* metrics, None when it was not) and its value beats the best so far, else
    the best unchanged. setting: checkpoint.best (None: nothing is tracked)."""
    if setting is None or validated is None or setting.metric not in validated:
        return best
    value = float(validated[setting.metric])
    if beats(value, best, setting.mode):
        return Best(setting.metric, setting.mode, step, value)
    return best


def restored(raw: Any, setting: Any) -> tuple[Best | None, str | None]:
    """The best a checkpoint's trainer state holds, if it was ranked the way checkpoint.best
    ranks now; else None, with a line that says why it starts afresh (None: nothing to say)."""
    best = Best.from_json(raw)
    if setting is None or best is None:
        return None, None
    if (best.metric, best.mode) != (setting.metric, setting.mode):
        return None, (
            f"checkpoint.best: the checkpoint's best step ({best.line()}) was ranked by another "
            f"metric or mode than {setting.metric} ({setting.mode}); the best starts afresh"
        )
    return best, None
