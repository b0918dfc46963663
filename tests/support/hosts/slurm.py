"""A real Slurm cluster across emulated hosts.

munged and slurmctld run in the root namespace (this machine is the controller, reached by
the hosts at the bridge address under its own hostname); one slurmd per host runs inside
that host's namespaces as `slurmd -N node<k>`. Configuration, state and the munge key live
in the hosts' state dir, logs in a directory the caller chooses.

There is no slurmdbd, so `sacct` has nothing to read. A finished job stays visible to
`scontrol show job` for MinJobAge seconds (set to an hour here), which is where job()
reads state and exit code; jobcomp/filetxt also appends one line per finished job to
<log_dir>/jobcomp.txt as a lasting record.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.hosts.netns import HostProcess, Hosts
from tests.support.hosts.procs import HostsError, kill, wait_until

if TYPE_CHECKING:
    from typing import Self

REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
MUNGE_USER = "munge"
PARTITION = "main"  # the default partition, holding every node


def slurm_unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [name for name in REQUIRED_BINARIES if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm/munge binaries missing ({', '.join(missing)}): "
            "run .ci/setup-system as root (Debian: munge slurmctld slurmd slurm-client)"
        )
    try:
        pwd.getpwnam(MUNGE_USER)
    except KeyError:
        return f"user {MUNGE_USER!r} is missing: reinstall the munge package"
    return None


@dataclass(frozen=True)
class SlurmJob:
    """A job as `scontrol show job` reports it."""

    job_id: int
    state: str  # e.g. RUNNING, COMPLETED, FAILED, CANCELLED
    exit_code: int  # the batch script's exit status
    signal: int  # the signal that ended it, 0 if none
    nodes: str  # e.g. node[1-3]
    fields: Mapping[str, str]  # every Key=Value of the record

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Key=Value pairs of one `scontrol -o` record (values have no spaces, except Reason)."""
    fields: dict[str, str] = {}
    key = None
    for token in line.split():
        name, sep, value = token.partition("=")
        if sep and name and name[0].isupper():
            key = name
            fields[key] = value
        elif key is not None:
            fields[key] += " " + token  # a value with spaces, e.g. Reason=...
    return fields


def node_feature(index: int) -> str:
    """The GPU feature the cluster gives its index-th node, for jobs that ask for one of several
    GPU types (--constraint): the first two nodes h100, the others a100 (no GPUs behind them)."""
    return "h100" if index < 2 else "a100"


def _render_slurm_conf(
    *,
    cluster_name: str,
    hosts: Hosts,
    ctld_port: int,
    state: Path,
    logs: Path,
    munge_socket: Path,
    cpus: int,
    memory_mb: int,
) -> str:
    lines = [
        f"ClusterName={cluster_name}",
        # slurmctld insists that one SlurmctldHost is this machine's hostname; the address
        # is where slurmds and job steps on the hosts reach it.
        f"SlurmctldHost={socket.gethostname()}({hosts.bridge_ip})",
        f"SlurmctldPort={ctld_port}",
        "SlurmdPort=6818",  # each slurmd has its host's network namespace to itself
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={state}/ctld",
        f"SlurmdSpoolDir={state}/spool/%n",
        f"SlurmctldPidFile={state}/slurmctld.pid",
        f"SlurmdPidFile={state}/slurmd-%n.pid",
        f"SlurmctldLogFile={logs}/slurmctld.log",
        f"SlurmdLogFile={logs}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroup confinement: processes are tracked through /proc, which each host's
        # PID namespace already scopes to that host.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={logs}/jobcomp.txt",
        "MpiDefault=none",
        "MailProg=/bin/true",  # Debian's default mailer is not installed
        "SwitchType=switch/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "MinJobAge=3600",  # keep finished jobs in `scontrol show job` (no slurmdbd)
        "KillWait=5",
        "SlurmdTimeout=60",
        "SlurmctldTimeout=60",
        "InactiveLimit=0",
        "SlurmdParameters=config_overrides",  # trust CPUs/RealMemory below, not the probe
    ]
    for i, host in enumerate(hosts):
        lines.append(
            f"NodeName={host.name} NodeAddr={host.ip} NodeHostname={host.name} "
            f"CPUs={cpus} RealMemory={memory_mb} Features={node_feature(i)} State=UNKNOWN"
        )
    nodes = ",".join(hosts.names)
    lines.append(f"PartitionName={PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path} does not exist)"
    return f"--- {path} (last {lines} lines)\n" + "\n".join(text[-lines:])


class SlurmCluster:
    """slurmctld + munged here, one slurmd per emulated host. Start with SlurmCluster.start."""

    def __init__(self, hosts: Hosts, log_dir: Path, state_dir: Path) -> None:
        self.hosts = hosts
        self.log_dir = log_dir
        self.state_dir = state_dir
        self.conf_path = state_dir / "etc" / "slurm.conf"
        self.munge_socket = state_dir / "munge" / "munge.socket"
        self.partition = PARTITION
        self._daemons: list[subprocess.Popen[bytes]] = []  # root namespace: munged, slurmctld
        self._slurmds: list[HostProcess] = []
        self._stopped = False

    @property
    def env(self) -> dict[str, str]:
        """What a client command (sbatch, srun, squeue, ...) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    @classmethod
    def start(
        cls,
        hosts: Hosts,
        log_dir: Path,
        *,
        cpus_per_node: int = 2,
        memory_mb: int = 1024,
        timeout: float = 60.0,
    ) -> SlurmCluster:
        """Configure and start munged, slurmctld and every slurmd; wait until all nodes idle."""
        reason = slurm_unavailable_reason()
        if reason is not None:
            raise HostsError(reason)
        cluster = cls(hosts, log_dir, hosts.state_dir / "slurm")
        try:
            cluster._start(cpus_per_node, memory_mb, timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, cpus: int, memory_mb: int, timeout: float) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("etc", "ctld", *(f"spool/{name}" for name in self.hosts.names)):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self._start_munged(timeout)
        self.conf_path.write_text(
            _render_slurm_conf(
                cluster_name=f"rlx{self.hosts.slot}",
                hosts=self.hosts,
                ctld_port=_free_port(),
                state=self.state_dir,
                logs=self.log_dir,
                munge_socket=self.munge_socket,
                cpus=cpus,
                memory_mb=memory_mb,
            )
        )
        (self.conf_path.parent / "cgroup.conf").write_text(CGROUP_CONF)
        self._spawn_daemon(
            ["slurmctld", "-D", "-c", "-f", str(self.conf_path)], self.log_dir / "slurmctld.out"
        )
        for host in self.hosts:
            with open(self.log_dir / f"slurmd-{host.name}.out", "wb") as out:
                self._slurmds.append(
                    host.popen(
                        ["slurmd", "-D", "-N", host.name, "-f", str(self.conf_path)],
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        self.wait_idle(timeout)

    def _start_munged(self, timeout: float) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(exist_ok=True)
        uid, gid = pwd.getpwnam(MUNGE_USER).pw_uid, grp.getgrnam(MUNGE_USER).gr_gid
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        # Clients of every user must reach the socket: munged wants the directory 0755.
        for path, mode in ((munge_dir, 0o755), (key, 0o400)):
            os.chown(path, uid, gid)
            path.chmod(mode)
        self._spawn_daemon(
            [
                "munged",
                "--foreground",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            self.log_dir / "munged.out",
            run_as=(uid, gid),
        )
        wait_until(
            lambda: self.munge_socket.exists() or self._daemons[-1].poll() is not None,
            timeout,
            "munged's socket",
        )
        if self._daemons[-1].poll() is not None:
            raise HostsError(
                "munged exited at start\n"
                + _tail(self.log_dir / "munged.out")
                + "\n"
                + _tail(munge_dir / "munged.log")
            )

    def _spawn_daemon(
        self, argv: list[str], output: Path, run_as: tuple[int, int] | None = None
    ) -> None:
        """Start a root-namespace daemon that dies with us, and register it with the hosts."""
        # setpriv sets the parent-death signal after switching user (a switch clears it).
        user = [] if run_as is None else [f"--reuid={run_as[0]}", f"--regid={run_as[1]}"]
        if run_as is not None:
            user.append("--init-groups")
        with open(output, "wb") as out:
            daemon = subprocess.Popen(
                ["setpriv", *user, "--pdeathsig", "KILL", "--", *argv],
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._daemons.append(daemon)
        self.hosts.register_daemon(daemon.pid)

    # Client commands -----------------------------------------------------------------
    def command(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = True,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command on this machine (the login node) against the cluster."""
        done = subprocess.run(
            list(argv),
            env={**os.environ, **self.env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise HostsError(
                f"{' '.join(argv)} exited {done.returncode}\n"
                f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        return done

    def sbatch(
        self,
        args: Sequence[str],
        *,
        wait: bool = False,
        timeout: float = 300.0,
        cwd: str | os.PathLike[str] | None = None,
    ) -> tuple[int, subprocess.CompletedProcess[str]]:
        """Submit with `sbatch --parsable [--wait] *args`; the job id and sbatch's result.

        With wait=True sbatch returns when the job ends and exits with its exit code, so
        the result is not checked; without it a failed submission raises HostsError.
        """
        argv = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args]
        done = self.command(argv, timeout=timeout, check=not wait, cwd=cwd)
        first = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        if not first.split(";")[0].isdigit():
            raise HostsError(
                f"sbatch gave no job id\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        return int(first.split(";")[0]), done

    def job(self, job_id: int) -> SlurmJob:
        done = self.command(["scontrol", "-o", "show", "job", str(job_id)])
        fields = parse_scontrol_record(done.stdout.strip().splitlines()[0])
        status, _, sig = fields.get("ExitCode", "0:0").partition(":")
        return SlurmJob(
            job_id=job_id,
            state=fields.get("JobState", "UNKNOWN"),
            exit_code=int(status),
            signal=int(sig or 0),
            nodes=fields.get("NodeList", ""),
            fields=fields,
        )

    def wait_job(
        self, job_id: int, *, states: frozenset[str] = TERMINAL_STATES, timeout: float = 120.0
    ) -> SlurmJob:
        """Poll until the job reaches one of `states` (default: any finished state)."""
        seen: list[SlurmJob] = []

        def reached() -> bool:
            seen.append(self.job(job_id))
            return seen[-1].state in states

        wait_until(reached, timeout, f"job {job_id} to reach {sorted(states)}")
        return seen[-1]

    def node_states(self) -> dict[str, str]:
        """Node name -> sinfo's compact state (idle, alloc, down*, ...)."""
        done = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        if done.returncode != 0:
            return {}
        pairs = (line.split() for line in done.stdout.splitlines() if line.strip())
        return {name: state for name, state in pairs}

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every node is idle; the error shows node states and log tails."""
        wanted = set(self.hosts.names)

        def all_idle() -> bool:
            self._check_daemons()
            states = self.node_states()
            return set(states) == wanted and all(state == "idle" for state in states.values())

        try:
            wait_until(all_idle, timeout, "all Slurm nodes to be idle")
        except HostsError as err:
            raise HostsError(f"{err}; nodes: {self.node_states()}\n{self.diagnostics()}") from None

    def _check_daemons(self) -> None:
        dead = [p.args for p in [*self._daemons, *self._slurmds] if p.poll() is not None]
        if dead:
            raise HostsError(f"Slurm daemons exited: {dead}\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        logs = [self.log_dir / "slurmctld.log", self.log_dir / "slurmctld.out"]
        logs += [self.log_dir / f"slurmd-{name}.log" for name in self.hosts.names]
        return "\n".join(_tail(path, 15) for path in logs)

    def active_jobs(self) -> list[int]:
        """Queued and running jobs; a heterogeneous job (listed per component, "5+0",
        "5+1") once, by its id."""
        done = self.command(["squeue", "-h", "-o", "%i"])
        ids = [int(job.split("+")[0]) for job in done.stdout.split()]
        return list(dict.fromkeys(ids))

    def cancel_all(self, timeout: float = 60.0) -> None:
        """scancel every job and wait until the queue is empty."""
        jobs = self.active_jobs()
        if jobs:
            self.command(["scancel", *map(str, jobs)], check=False)
        wait_until(lambda: not self.active_jobs(), timeout, "the Slurm queue to drain")

    # Shutdown --------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel jobs, stop every daemon and remove configuration and state. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._daemons and self._daemons[-1].poll() is None and self._slurmds:
            with contextlib.suppress(HostsError, subprocess.TimeoutExpired):
                self.cancel_all(timeout=30)  # the daemons go regardless
        for proc in [*self._slurmds, *reversed(self._daemons)]:
            proc.terminate()
        for proc in [*self._slurmds, *reversed(self._daemons)]:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                if isinstance(proc, HostProcess):
                    proc.kill_tree()
                else:
                    kill(proc.pid)
                proc.wait()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
