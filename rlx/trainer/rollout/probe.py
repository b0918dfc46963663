"""The proof that a rollout engine holds the policy's weights.

After every weight push the controller checks every engine: its weight version must equal
the policy's, and its log-prob of a fixed probe sequence must match the policy's own within
a tolerance suited to the dtype. A mismatch is a StaleEngineError, never a warning: training
on samples from other weights than the ones being updated silently breaks the algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlx.errors import RlxError

# The fixed probe response every engine and the policy score after each weight push.
PROBE_TEXT = "0123456789 abcdefghij"

# Log-prob agreement per probe token: float32 copies of the same weights agree to rounding;
# half precision (and vLLM's kernels against torch's) only to about a hundredth.
PROBE_TOLERANCE_PER_TOKEN = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 2e-2}
PROBE_TOLERANCE_FLOOR = 1e-3
# Plus a share of the log-probs' own size, in units of the dtype's resolution (its epsilon):
# rounding in bf16 over many layers grows with the logits, and an unlikely probe token has a
# large log-prob. A wrong or missing push moves the probe by far more.
PROBE_RELATIVE_EPS = 2.0
DTYPE_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


class StaleEngineError(RlxError):
    """A rollout engine does not hold the policy's current weights."""


@dataclass(frozen=True)
class Probe:
    """A fixed prompt and response every engine and the policy score after each update."""

    prompt_ids: list[int]
    response_ids: list[int]

    def tolerance(self, dtype: str, policy_logprob: float = 0.0) -> float:
        """How far an engine in `dtype` may score the probe from the policy's value
        (policy_logprob, the sum over the probe's tokens): a bound per token plus a share
        of the value's size, both set by the dtype."""
        per_token = PROBE_TOLERANCE_PER_TOKEN.get(dtype, PROBE_TOLERANCE_PER_TOKEN["bfloat16"])
        eps = DTYPE_EPS.get(dtype, DTYPE_EPS["bfloat16"])
        relative = PROBE_RELATIVE_EPS * eps * abs(policy_logprob)
        return max(per_token * len(self.response_ids) + relative, PROBE_TOLERANCE_FLOOR)


@dataclass(frozen=True)
class EngineReport:
    """What an engine says after a weight push: the version it holds and its probe value."""

    index: int
    node: str
    version: int
    probe_logprob: float
    # A streamed push (split engines): (tensors received, tensors the push sent).
    received: tuple[int, int] | None = None


def check_engines(
    reports: Sequence[EngineReport], version: int, policy_logprob: float, tolerance: float
) -> float:
    """Raise StaleEngineError unless every engine holds `version` and scores the probe like
    the policy. Returns the largest probe difference seen (a metric worth watching)."""
    worst = 0.0
    for report in reports:
        where = f"rollout engine {report.index} (node {report.node})"
        if report.received is not None and report.received[0] != report.received[1]:
            got, sent = report.received
            raise StaleEngineError(
                f"{where} received {got} of the {sent} tensors of weights version {version}: "
                "the push was partial; stopping rather than training on samples from mixed "
                "weights"
            )
        if report.version != version:
            raise StaleEngineError(
                f"{where} holds weights version {report.version} but the policy is at "
                f"version {version}: the weight push did not arrive; stopping rather than "
                "training on samples from old weights"
            )
        diff = abs(report.probe_logprob - policy_logprob)
        if not math.isfinite(diff) or diff > tolerance:
            raise StaleEngineError(
                f"{where} scores the probe sequence {report.probe_logprob:.6g} but the policy "
                f"scores it {policy_logprob:.6g} (difference {diff:.3g}, tolerance "
                f"{tolerance:.3g}): its weights are not the policy's although it reports "
                f"version {version}"
            )
        worst = max(worst, diff)
    return worst
