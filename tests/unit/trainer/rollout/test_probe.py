from __future__ import annotations

import math

import pytest

from rlx.errors import RlxError
from rlx.trainer.rollout.probe import EngineReport, Probe, StaleEngineError, check_engines


def report(version: int, value: float, index: int = 0) -> EngineReport:
    return EngineReport(index, "10.0.0.2", version, value)


def test_engines_in_step_pass_and_report_the_largest_difference() -> None:
    worst = check_engines([report(5, -20.0), report(5, -20.0005, 1)], 5, -20.0, 1e-3)
    assert worst == pytest.approx(5e-4)


def test_an_engine_behind_is_an_error_naming_it() -> None:
    with pytest.raises(
        StaleEngineError,
        match=r"rollout engine 1 \(node 10.0.0.2\) holds weights version 4 but the policy "
        r"is at version 5",
    ):
        check_engines([report(5, -20.0), report(4, -20.0, 1)], 5, -20.0, 1e-3)


@pytest.mark.parametrize("value", [-21.0, math.nan])
def test_an_engine_with_other_weights_is_an_error_even_at_the_right_version(value) -> None:
    with pytest.raises(StaleEngineError, match="its weights are not the policy's"):
        check_engines([report(5, value)], 5, -20.0, 1e-3)
    assert issubclass(StaleEngineError, RlxError)  # one line at the CLI, exit 1


def test_probe_tolerance_scales_with_length_and_dtype() -> None:
    probe = Probe([1, 2], list(range(20)))
    assert probe.tolerance("float32") == pytest.approx(2e-3)
    assert probe.tolerance("bfloat16") == pytest.approx(1.0)
    assert Probe([1], [2]).tolerance("float32") == pytest.approx(1e-3)  # the floor


def test_probe_tolerance_grows_with_the_probe_value_by_the_dtype_resolution() -> None:
    probe = Probe([1, 2], list(range(20)))
    # An unlikely probe (sum -200 over 20 tokens): bf16 allows two of its epsilons (2^-7)
    # of the value on top of 0.05 per token; float32's epsilon adds next to nothing.
    assert probe.tolerance("bfloat16", -200.0) == pytest.approx(1.0 + 2 * 2**-7 * 200)
    assert probe.tolerance("float16", -200.0) == pytest.approx(0.4 + 2 * 2**-10 * 200)
    assert probe.tolerance("float32", -200.0) == pytest.approx(2e-3 + 2 * 2**-23 * 200)
    # A stale bf16 engine of a 64-layer model that misses a push moves the probe by whole
    # nats: still caught, and a bf16 rounding difference of 2 nats is not.
    tolerance = probe.tolerance("bfloat16", -200.0)
    assert 2.0 < tolerance < 5.0
    with pytest.raises(StaleEngineError):
        check_engines([report(5, -206.0)], 5, -200.0, tolerance)
