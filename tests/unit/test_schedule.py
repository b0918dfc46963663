"""`make test`'s schedule (tests/support/schedule.py): its units, the timings it orders them
by, and the file those timings live in."""

from __future__ import annotations

from tests.conftest import REPO
from tests.support.schedule import TIMINGS, load_timings, timings_from_log, unit_of


def test_a_host_test_is_a_unit_and_any_other_test_goes_with_its_module():
    host = "tests/hosts/test_multinode.py::test_a_lost_worker_fails_the_job_fast[slurm]"
    assert unit_of(host) == host
    other = "tests/integration/node/test_bootstrap.py::test_token_auth_and_success"
    assert unit_of(other) == "tests/integration/node/test_bootstrap.py"


def test_the_rehearsals_run_as_one_module_in_a_fresh_worker():
    from tests.support.schedule import SPLIT

    rehearsal = "tests/integration/trainer/test_rehearsal.py::test_a_shipped_gpu_recipe[ppo-7b]"
    assert unit_of(rehearsal) == "tests/integration/trainer/test_rehearsal.py"
    assert all((REPO / module).is_file() for module in SPLIT)
    # A host test is a unit of its own whatever SPLIT holds.
    assert (
        unit_of("tests/hosts/test_slurm.py::test_requeue")
        == "tests/hosts/test_slurm.py::test_requeue"
    )


def test_a_tests_seconds_are_its_setup_call_and_teardown():
    log = [
        "============================= slowest durations ==============================",
        "222.72s call     tests/hosts/test_slurm.py::test_requeue",
        "91.39s setup    tests/integration/trainer/test_resume.py::test_two_ranks[a b]",
        "59.89s teardown tests/hosts/test_slurm.py::test_requeue",
        "0.10s call     tests/unit/test_cli.py::test_help",
        "664 passed, 27 warnings in 1634.55s (0:27:14)",
    ]
    assert timings_from_log(log) == {
        "tests/hosts/test_slurm.py::test_requeue": 282.6,
        "tests/integration/trainer/test_resume.py::test_two_ranks[a b]": 91.4,
        "tests/unit/test_cli.py::test_help": 0.1,
    }


def test_the_recorded_timings_load_and_name_tests():
    timings = load_timings()
    assert TIMINGS.is_file() and len(timings) > 50
    assert all(name.startswith("tests/") and "::" in name for name in timings)
    assert all(seconds >= 0.0 for seconds in timings.values())


def test_an_unknown_test_counts_by_its_tier():
    from tests.support.schedule import expected_seconds

    assert expected_seconds({"tests/unit/a.py::t": 3.0}, "tests/unit/a.py::t") == 3.0
    assert expected_seconds({}, "tests/hosts/a.py::t") > expected_seconds({}, "tests/unit/a.py::t")
