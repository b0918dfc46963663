"""PID 1 of one emulated host.

Started (as root) inside fresh mount, PID, UTS and IPC namespaces and the host's network
namespace. It gives the host its hostname, its own /tmp/ray and /dev/shm, an /etc/hosts
that names every emulated host and an /etc/resolv.conf with no reachable server; says
"ready" on stdout, then reaps orphans until told to stop. When it exits the kernel kills
every other process of the host, which is how a host is shut down. Standard library only:
it runs as a plain script, not as part of a package.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

PRIVATE_TMPFS = ("/tmp/ray", "/dev/shm")
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def set_up_host(hostname: str, hosts_file: str, resolv_file: str) -> None:
    socket.sethostname(hostname)
    for target in PRIVATE_TMPFS:
        # The mount point lives on the shared filesystem; the tmpfs on it is this host's own.
        os.makedirs(target, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "mode=1777", f"rlx-{hostname}", target], check=True
        )
    subprocess.run(["mount", "--bind", hosts_file, "/etc/hosts"], check=True)
    # The hosts have no route to this machine's DNS server: lookups of unknown names (and
    # the IPv6 lookups that precede IPv4 ones) must fail at once instead of timing out.
    subprocess.run(["mount", "--bind", resolv_file, "/etc/resolv.conf"], check=True)


def reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve() -> None:
    # Blocked signals are collected by sigwait: no handler can interrupt a reap half way.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS | {signal.SIGCHLD})
    while True:
        received = signal.sigwait(STOP_SIGNALS | {signal.SIGCHLD})
        if received == signal.SIGCHLD:
            reap_children()
        else:
            return


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--resolv-file", required=True)
    args = parser.parse_args(argv)
    if os.getpid() != 1:
        print("hostinit: must be PID 1 of a new PID namespace", file=sys.stderr)
        return 2
    set_up_host(args.hostname, args.hosts_file, args.resolv_file)
    print("ready", flush=True)
    # Nobody reads stdout after "ready"; keep writes from blocking or failing later.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
