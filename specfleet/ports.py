"""Listening sockets for a service's side ports (HTTP API, metrics), bound at start-up."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


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
            return None
        raise OSError(f"{what}: cannot listen on {host}:{port} ({err.strerror}); set {key} to a free port (0 turns it off)") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock
