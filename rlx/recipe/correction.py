"""What algo.rollout_correction's bounds may be, worded once for lint, start-up and the loss.
Light: no torch (lint imports it)."""

from __future__ import annotations

from rlx.recipe.model import AlgorithmSettings


def correction_bounds_problem(low: float, high: float) -> str | None:
    """What is wrong with the bounds [low, high], or None. They must hold weight 1 (0 <= low
    <= 1 <= high), or the correction would change a batch where engine and learner agree."""
    if not 0.0 <= low <= 1.0 <= high:
        return (
            f"rollout correction bounds low={low}, high={high} must satisfy 0 <= low <= 1 <= "
            "high, so that a token the engine and learner agree on keeps weight 1; write e.g. "
            "low: 0.5, high: 2.0"
        )
    return None


def correction_bounds(algo: AlgorithmSettings) -> tuple[float, float]:
    """[low, high] of algo.rollout_correction, unset ones filled: low 0, high the decoupled
    PPO cap (algo.behavior_weight_cap), so the default is the truncated token weight that
    max_staleness > 0 always had."""
    correction = algo.rollout_correction
    low = 0.0 if correction.low is None else correction.low
    high = algo.behavior_weight_cap if correction.high is None else correction.high
    return low, high


def rollout_correction_problem(algo: AlgorithmSettings) -> str | None:
    """A mask written without its bounds, or bounds that move weight 1; None if neither."""
    correction = algo.rollout_correction
    if correction.action == "mask" and (correction.low is None or correction.high is None):
        return (
            "action mask drops tokens outside [low, high], so both bounds must be written "
            "(e.g. low: 0.5, high: 2.0, IcePop's); or write action: truncate"
        )
    return correction_bounds_problem(*correction_bounds(algo))
