"""A fault-injecting HTTP proxy on loopback, in front of a real store's server (moto's S3):
it answers a share of requests 503 SlowDown as a throttled S3 does, resets the connection in
the middle of an upload's body, or holds a request without an answer past the client's
timeout; everything else it forwards to the store unchanged. One request per connection
(it answers `Connection: close`), which clients handle as any server closing idle
connections. Counts what it did, so a test can hold the client's retries against it."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Faults:
    """What the proxy does to the requests it sees; changed by the test as it goes."""

    unavailable: float = 0.0  # share of requests answered 503 SlowDown
    resets: int = 0  # uploads (a PUT or POST with a body) to cut off halfway, with a TCP reset
    reset_min_bytes: int = 1 << 16  # only bodies at least this long count as an upload
    stall: bool = False  # hold every request without an answer
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"503": 0, "reset": 0, "stall": 0})


class FaultyProxy:
    def __init__(self, upstream: tuple[str, int], faults: Faults):
        self.upstream = upstream
        self.faults = faults
        self._random = random.Random(faults.seed)
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _decide(self, method: str, length: int) -> str:
        with self._lock:
            faults = self.faults
            if faults.stall:
                faults.counts["stall"] += 1
                return "stall"
            upload = method in ("PUT", "POST") and length >= faults.reset_min_bytes
            if upload and faults.resets > 0:
                faults.resets -= 1
                faults.counts["reset"] += 1
                return "reset"
            if self._random.random() < faults.unavailable:
                faults.counts["503"] += 1
                return "503"
            return "forward"

    def _serve(self, client: socket.socket) -> None:
        with contextlib.closing(client):
            try:
                head, body_start = _read_head(client)
            except OSError:
                return
            if not head:
                return
            lines = head.split(b"\r\n")
            method = lines[0].split(b" ", 1)[0].decode()
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get(b"content-length", b"0") or 0)
            action = self._decide(method, length)
            if action == "stall":
                self._closed.wait(600)
                return
            # botocore asks before a large body (Expect: 100-continue): a 503 goes at once.
            expects = headers.get(b"expect", b"").lower() == b"100-continue"
            if expects and action != "503":
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            if action == "reset":  # half the body, then a reset (RST, not a clean close)
                with contextlib.suppress(OSError):
                    _read_exactly(client, max(length // 2 - len(body_start), 0))
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            if action != "503" or not expects:
                body = body_start + _read_exactly(client, length - len(body_start))
            if action == "503":
                client.sendall(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                    + f"Content-Length: {len(SLOW_DOWN)}\r\nConnection: close\r\n\r\n".encode()
                    + (b"" if method == "HEAD" else SLOW_DOWN)
                )
                return
            dropped = (b"connection:", b"expect:")
            kept = [line for line in lines[1:] if not line.lower().startswith(dropped)]
            request = b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n" + body
            with socket.create_connection(self.upstream) as upstream:
                upstream.sendall(request)
                client.sendall(_read_response(upstream, method))


def _read_response(sock: socket.socket, method: str) -> bytes:
    """One whole response (the server may keep its connection open): head, then the body
    its Content-Length gives (none for HEAD), or everything until the server closes."""
    head, body = _read_head(sock)
    status = head.split(b" ", 2)[1] if head else b""
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if method == "HEAD" or status in (b"204", b"304"):
        length = 0
    if length is None:
        while chunk := sock.recv(1 << 16):
            body += chunk
    else:
        body += _read_exactly(sock, length - len(body))
    return head + b"\r\n\r\n" + body


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    parts = []
    while count > 0:
        chunk = sock.recv(min(count, 1 << 16))
        if not chunk:
            break
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


@contextlib.contextmanager
def faulty_proxy(endpoint: str, faults: Faults) -> Iterator[FaultyProxy]:
    """A FaultyProxy in front of endpoint (http://host:port), closed on exit."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    proxy = FaultyProxy((host, int(port)), faults)
    try:
        yield proxy
    finally:
        proxy.close()
