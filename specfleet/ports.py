"""Listening sockets for a service's side ports (HTTP API, metrics), bound at start-up, and what each process
tells `specfleet serve` of them, so that serve prints what listens rather than what was asked for."""

from __future__ import annotations

import json
import logging
import os
import socket

log = logging.getLogger(__name__)

# A file `specfleet serve` gives its services (in their environment): each appends a JSON line per side port.
SIDE_PORTS_ENV = "SPECFLEET_SIDE_PORTS_FILE"


def report(what: str, address: str | None, why: str = "") -> None:
    """Tell `specfleet serve`, when it started this process, that `what` listens on `address`, or is off (None) and why."""
    path = os.environ.get(SIDE_PORTS_ENV)
    if path:
        with open(path, "a") as out:  # one short write a line: lines of several processes do not interleave
            out.write(json.dumps({"what": what, "address": address, "why": why}) + "\n")


def reported(path: str) -> dict[str, dict]:
    """What the services reported, by `what` (the latest line of each)."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    return {entry["what"]: entry for entry in map(json.loads, filter(None, lines))}


def listen(host: str, configured: int | None, default: int, what: str, key: str) -> socket.socket | None:
    """A bound, listening socket, or None when the port is off.

    configured: 0 turns it off; a port number must be free (start-up fails naming `key`
    otherwise); None means `default` when it is free, else off with a warning, so that a
    second deployment on one machine starts without editing its config.
    """
    if configured == 0:
        return None
    port = default if configured is None else configured
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if configured is None:
            log.warning("%s off: its default port %s:%d is in use (%s); set %s to another port", what, host, port, err.strerror, key)
            report(what, None, f"its default port {port} is in use; set {key} to another port")
            return None
        raise OSError(f"{what}: cannot listen on {host}:{port} ({err.strerror}); set {key} to a free port (0 turns it off)") from None
    sock.listen(128)
    sock.setblocking(False)
    report(what, f"{host}:{sock.getsockname()[1]}")
    return sock
