"""Ray cluster bring-up on three emulated hosts, and how fast failures are detected.

    sudo python bench/bringup.py [--runs 5] [--no-detection] [--backends sky,dstack,slurm]

Bring-up: the time from "every host starts its run block" to "the trainer command starts
with 3/3 nodes joined", median of --runs runs (interleaved a/b/c, fresh hosts each run):

  a. rlx     rlx's rendered SkyPilot run block (`rlx node`), token auth on;
  b. sky     SkyPilot's own Ray template as its docs use it
             (`~/sky_templates/ray/start_cluster`, then the trainer on rank 0; needs `uv`);
  c. floor   the same `ray start` commands as rlx with only polling: the head starts, polls
             the node table every 0.1 s and starts the trainer at 3/3; workers poll the
             head's GCS port every 0.1 s, then join.

Every run block runs under SkyPilot's own task script (tests/hosts/rendered.py), with the
trainer command `date +%s.%N > FILE`. Failure detection: the scenarios of
tests/hosts/test_multinode.py, timed once per backend.

Needs root (network, mount and PID namespaces); without it, it says so and exits 0.
It is a benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN_TIMEOUT = 180.0
VARIANTS = ("rlx", "sky", "floor")
JOIN_TIMEOUT = 120  # bring-up runs: never the limit

# The floor's head: poll the GCS node table until N nodes are ALIVE.
FLOOR_POLL = """\
import sys, time
from ray._raylet import GcsClient
client = GcsClient(address=sys.argv[1])
want = int(sys.argv[2])
while sum(n.state == 0 for n in client.get_all_node_info(timeout=5).values()) < want:
    time.sleep(0.1)
"""


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (emulated hosts use network, mount and PID namespaces)"
    from tests.hosts import unavailable_reason

    return unavailable_reason()


@contextmanager
def fresh_hosts(n: int = 3) -> Iterator:
    from tests.hosts import Hosts

    with Hosts.create(n) as hosts, tempfile.TemporaryDirectory(prefix="rlx-bench-") as tmp:
        yield hosts, Path(tmp)


def trainer_line(marker: Path) -> str:
    return f"date +%s.%N > {shlex.quote(str(marker))}"


# ------------------------------------------------------------------------- run blocks


def rlx_job(hosts, workdir: Path, marker: Path):
    import yaml
    from tests.hosts.rendered import RenderedJob

    from rlx.launchers.base import collect_secrets
    from rlx.recipe import parse_recipe

    text = yaml.safe_dump(
        {
            "name": "bringup",
            "resources": {"nodes": len(hosts)},
            "command": [trainer_line(marker)],
            "ray": {"join_timeout": JOIN_TIMEOUT},
        }
    )
    recipe = parse_recipe(text, "bringup.yaml").recipe
    return RenderedJob.from_recipe("sky", recipe, hosts, workdir), collect_secrets(recipe, {})


def sky_template_job(hosts, workdir: Path, marker: Path):
    from tests.hosts.rendered import RenderedJob

    run_block = (
        "~/sky_templates/ray/start_cluster\n"
        'if [ "${SKYPILOT_NODE_RANK}" = "0" ]; then\n'
        f"  {trainer_line(marker)}\n"
        "fi\n"
    )
    return RenderedJob("sky", hosts, workdir, run_block), {}


def floor_job(hosts, workdir: Path, marker: Path):
    from tests.hosts.rendered import RenderedJob

    from rlx.node import raynode
    from rlx.recipe.model import RaySettings

    settings = RaySettings()
    head = hosts[0].ip
    poller = workdir / "floor_poll.py"
    poller.write_text(FLOOR_POLL)
    q = shlex.join
    head_start = q(raynode.launch_argv(raynode.head_command(settings, head, 0)))
    workers = []
    for host in hosts[1:]:
        join = q(raynode.launch_argv(raynode.worker_command(settings, head, host.ip, 0)))
        workers.append(f'  "{host.ip}") {join} ;;')
    run_block = "\n".join(
        [
            "set -e",
            'if [ "${SKYPILOT_NODE_RANK}" = "0" ]; then',
            f"  {head_start} >/dev/null",
            f"  python {shlex.quote(str(poller))} {head}:{settings.port} {len(hosts)}",
            f"  {trainer_line(marker)}",
            "else",
            f"  until (exec 3<>/dev/tcp/{head}/{settings.port}) 2>/dev/null; do sleep 0.1; done",
            '  me=$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")',
            '  case "$me" in',
            *workers,
            "  esac >/dev/null",
            "fi",
        ]
    )
    # The same Ray environment rlx gives its own processes: token auth, fast health checks.
    token = "f" * 64
    env = {k: v for k, v in raynode.ray_env({}, token).items() if k.startswith("RAY_")}
    return RenderedJob("sky", hosts, workdir, run_block, env), {}


JOBS: dict[str, Callable] = {"rlx": rlx_job, "sky": sky_template_job, "floor": floor_job}


def bring_up(variant: str) -> float:
    """Seconds from starting every run block to the trainer's first line, on fresh hosts."""
    with fresh_hosts() as (hosts, workdir):
        marker = workdir / "trainer-start"
        job, secrets = JOBS[variant](hosts, workdir, marker)
        started = time.time()
        runs = job.start_all(secrets, task_id=f"bench-{variant}")
        deadline = time.monotonic() + RUN_TIMEOUT
        while not marker.exists() or not marker.read_text().strip():
            failed = [r for r in runs if r.proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                logs = "\n".join(f"--- {r.host.name}\n{r.output()[-3000:]}" for r in runs)
                raise RuntimeError(f"{variant}: the trainer did not start\n{logs}")
            time.sleep(0.02)
        elapsed = float(marker.read_text()) - started
        for run in runs:  # let rlx finish its own way; the others are torn down with the hosts
            if variant == "rlx":
                run.wait(RUN_TIMEOUT)
        return elapsed


def bringup_table(runs: int, variants: tuple[str, ...]) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(runs):
        for variant in variants:
            seconds = bring_up(variant)
            results[variant].append(seconds)
            print(f"  run {i + 1}/{runs} {variant:<6} {seconds:6.2f} s", flush=True)
    return results


def print_bringup(results: dict[str, list[float]]) -> None:
    med = {v: statistics.median(t) for v, t in results.items()}
    print()
    print("Bring-up on 3 emulated hosts (run blocks start -> trainer starts, 3/3 joined)")
    print(f"{'variant':<36} {'median s':>9} {'min s':>7} {'max s':>7}")
    labels = {
        "rlx": "a. rlx (rendered SkyPilot run block)",
        "sky": "b. SkyPilot ray/start_cluster",
        "floor": "c. floor (ray start + polling)",
    }
    for variant, times in results.items():
        print(f"{labels[variant]:<36} {med[variant]:>9.2f} {min(times):>7.2f} {max(times):>7.2f}")
    # Runs are interleaved, so a round's variants saw about the same machine load: the
    # median of per-round ratios is steadier than the ratio of medians on a busy machine.
    for other, label, target in (("floor", "floor", "<= 1.15"), ("sky", "skypilot", "< 0.5")):
        if other not in results:
            continue
        rounds = [a / b for a, b in zip(results["rlx"], results[other], strict=True)]
        print(
            f"rlx / {label:<8} = {med['rlx'] / med[other]:.2f} (ratio of medians), "
            f"{statistics.median(rounds):.2f} (median of per-round ratios)  target {target}"
        )


# ------------------------------------------------------------------- failure detection


def detection_times(backend: str, cluster=None) -> dict[str, float]:
    """Seconds to detect each failure of tests/hosts/test_multinode.py, for one backend."""
    from tests.hosts.probejob import Job, kill_leftovers, poll, ray_processes

    out: dict[str, float] = {}

    def job_on(hosts, workdir: Path, join_timeout: int) -> Job:
        return Job(backend, hosts, workdir, cluster, join_timeout=join_timeout)

    @contextmanager
    def place() -> Iterator:
        if cluster is None:
            with fresh_hosts() as pair:
                yield pair
        else:
            with tempfile.TemporaryDirectory(prefix="rlx-bench-") as tmp:
                try:
                    yield cluster.hosts, Path(tmp)
                finally:
                    (Path(tmp) / "probe" / "release").touch()
                    cluster.cancel_all()
                    kill_leftovers(cluster.hosts)

    with place() as (hosts, workdir):  # a node never starts (join timeout 30 s)
        job = job_on(hosts, workdir, 30)
        job.control(exit=0)
        run = job.start(stalled=(2,))
        started = job.head_started(run)
        code, ended = job.wait_head(run)
        assert code == 75, job.all_logs(run)
        out["missing node named (join timeout 30 s)"] = ended - started
        job.wait_all(run)

    with place() as (hosts, workdir):  # the head never comes up (join timeout 15 s)
        job = job_on(hosts, workdir, 15)
        job.control(exit=0)
        run = job.start(stalled=(0,))
        if cluster is not None:
            logs = [job.job_dir(run) / f"worker-{h.name}.log" for h in hosts[1:]]
            poll(lambda: all(p.exists() for p in logs), 60, "the worker steps")
        started = time.monotonic()
        poll(
            lambda: all("did not come up" in job.log(run, r) for r in (1, 2)),
            RUN_TIMEOUT,
            "the workers to give up",
            interval=0.05,
        )
        out["workers give up on the head (join timeout 15 s)"] = time.monotonic() - started
        job.wait_all(run)

    with place() as (hosts, workdir):  # a worker's raylet is killed mid-run
        job = job_on(hosts, workdir, JOIN_TIMEOUT)
        job.control(hold=True)
        run = job.start()
        poll(lambda: (job.out / "holding-1").exists(), RUN_TIMEOUT, "the trainer")
        os.kill(ray_processes(hosts[2], "raylet")[0], signal.SIGKILL)
        killed = time.monotonic()
        code, ended = job.wait_head(run)
        assert code == 75, job.all_logs(run)
        out["lost worker: raylet killed -> head exits"] = ended - killed
        job.wait_all(run)
    return out


def detection_table(backends: list[str]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for backend in backends:
        if backend == "slurm":
            from tests.hosts import Hosts, SlurmCluster, slurm_unavailable_reason

            reason = slurm_unavailable_reason()
            if reason is not None:
                print(f"  slurm: skipped ({reason})")
                continue
            with (
                tempfile.TemporaryDirectory(prefix="rlx-bench-slurm-") as logs,
                Hosts.create(3) as hosts,
                SlurmCluster.start(hosts, Path(logs)) as cluster,
            ):
                table[backend] = detection_times(backend, cluster)
        else:
            table[backend] = detection_times(backend)
        print(f"  {backend}: done", flush=True)
    return table


def print_detection(table: dict[str, dict[str, float]]) -> None:
    if not table:
        return
    backends = list(table)
    scenarios = list(next(iter(table.values())))
    print()
    print("Failure detection (seconds)")
    print(f"{'scenario':<48}" + "".join(f"{b:>9}" for b in backends))
    for scenario in scenarios:
        print(f"{scenario:<48}" + "".join(f"{table[b][scenario]:>9.1f}" for b in backends))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="bring-up runs per variant")
    parser.add_argument("--no-bringup", action="store_true", help="skip the bring-up table")
    parser.add_argument("--no-detection", action="store_true", help="skip failure detection")
    parser.add_argument("--backends", default="sky,dstack,slurm", help="for failure detection")
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"bench/bringup.py: skipped: {reason}")
        return
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    if not args.no_bringup:
        variants = VARIANTS
        if shutil.which("uv") is None:
            print("SkyPilot's template needs `uv` (pip install uv): leaving it out")
            variants = tuple(v for v in VARIANTS if v != "sky")
        print(f"Bring-up: {args.runs} runs each, interleaved")
        print_bringup(bringup_table(args.runs, variants))
    if not args.no_detection:
        print("\nFailure detection: one run per scenario and backend")
        print_detection(detection_table(args.backends.split(",")))


if __name__ == "__main__":
    main()
