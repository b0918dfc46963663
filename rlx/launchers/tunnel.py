"""A local port forwarded to a port on a job's head, through a command run on the head.

For every connection to 127.0.0.1:LOCAL, rlx runs a small relay on the head (through srun
on Slurm, the way ssh -L runs a channel through sshd) that connects to 127.0.0.1:REMOTE
there and copies bytes both ways over the relay's stdin and stdout. Nothing listens on any
address but this machine's loopback, and the head's dashboard stays on its own loopback.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence

# Runs on the head: stdin -> 127.0.0.1:PORT -> stdout, until either side closes.
RELAY = (
    "import os,socket,sys,threading\n"
    "s=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n"
    "def up():\n"
    "    while True:\n"
    "        b=os.read(0,65536)\n"
    "        if not b: break\n"
    "        s.sendall(b)\n"
    "    s.shutdown(socket.SHUT_WR)\n"
    "threading.Thread(target=up,daemon=True).start()\n"
    "while True:\n"
    "    b=s.recv(65536)\n"
    "    if not b: break\n"
    "    os.write(1,b)\n"
)


def relay_argv(remote_port: int, python: str = "python3") -> list[str]:
    return [python, "-c", RELAY, str(remote_port)]


def _pump(read: Callable[[int], bytes], write: Callable[[bytes], object], done: Callable) -> None:
    with contextlib.suppress(OSError, ValueError):
        while chunk := read(65536):
            write(chunk)
    done()


def _serve_one(conn: socket.socket, argv: Sequence[str]) -> None:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    assert proc.stdin is not None and proc.stdout is not None

    def close_stdin() -> None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]

    def close_conn() -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    up = threading.Thread(target=_pump, args=(conn.recv, proc.stdin.write, close_stdin))
    up.start()
    _pump(proc.stdout.read, conn.sendall, close_conn)
    up.join(timeout=5)
    with contextlib.suppress(OSError):
        conn.close()
    if proc.poll() is None:
        proc.terminate()
    proc.wait()


def listen(local_port: int) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", local_port))
    server.listen(16)
    return server


def serve(server: socket.socket, argv: Sequence[str], stop: threading.Event | None = None) -> None:
    """Accept connections until `stop` is set (or forever); each runs `argv` as its relay."""
    server.settimeout(0.5)
    while stop is None or not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        threading.Thread(target=_serve_one, args=(conn, list(argv)), daemon=True).start()
    server.close()
