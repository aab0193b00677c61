"""`specfleet serve`'s processes: start them, restart one that dies, stop them in order.

A verifier or drafter that crashes is started again (after 1 s, doubling to at most 30 s while it
keeps crashing); the router carries its requests through meanwhile (without drafts while a drafter
is away, waiting for a verifier, then rebuilding its KV from the token ids). A service that crashes
more than `max_restarts` times within RESTART_WINDOW_S is reported and everything stops: that is a
failure a restart does not fix (a bad model file, a device that went away).
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

RESTART_WINDOW_S = 600.0
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0


@dataclass
class Child:
    name: str
    command: list[str]
    cpus: list[int]
    env: dict[str, str] | None = None  # None: this process's environment
    proc: subprocess.Popen | None = None
    crashes: collections.deque = field(default_factory=collections.deque)  # when it died, within the window
    start_at: float | None = None  # a restart is due then
    restarts: int = 0


class GaveUp(Exception):
    """A service crashed too often to keep restarting it."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(self, preexec: Callable[[list[int]], Callable[[], None]], max_restarts: int, clock=time.monotonic):
        self.children: list[Child] = []
        self._preexec = preexec
        self.max_restarts = max_restarts
        self._clock = clock

    def start(self, name: str, command: list[str], cpus: list[int], env: dict[str, str] | None = None) -> Child:
        child = Child(name, command, cpus, env)
        self.children.append(child)
        self._spawn(child)
        if cpus:
            print(f"specfleet serve: {name} runs on cores {cpus}", file=sys.stderr)
        return child

    def _spawn(self, child: Child) -> None:
        # Its own process group: Ctrl-C in a terminal signals the whole foreground group at once, and
        # the services must stop only after the router has drained (stop), not with it.
        child.proc = subprocess.Popen(child.command, preexec_fn=self._preexec(child.cpus), process_group=0, env=child.env)
        child.start_at = None

    def tend(self) -> None:
        """Restart the services that died, each after its delay; raises GaveUp past max_restarts."""
        now = self._clock()
        for child in self.children:
            if child.start_at is not None:
                if now >= child.start_at:
                    child.restarts += 1
                    print(f"specfleet serve: restarting {child.name} (restart {child.restarts})", file=sys.stderr, flush=True)
                    self._spawn(child)
                continue
            code = child.proc.poll() if child.proc is not None else None
            if code is None:
                continue
            child.crashes.append(now)
            while child.crashes and now - child.crashes[0] > RESTART_WINDOW_S:
                child.crashes.popleft()
            if len(child.crashes) > self.max_restarts:
                raise GaveUp(
                    f"{child.name} {describe_exit(code)}: {len(child.crashes)} crashes within {RESTART_WINDOW_S / 60:.0f} min,"
                    f" more than --max-restarts {self.max_restarts}; not restarting it (its log above says why)"
                )
            delay = min(MAX_RESTART_DELAY_S, FIRST_RESTART_DELAY_S * 2 ** (len(child.crashes) - 1))
            print(f"specfleet serve: {child.name} {describe_exit(code)}; restarting it in {delay:.0f}s", file=sys.stderr, flush=True)
            child.start_at = now + delay

    def stop(self, first: str, drain_s: float, rest_s: float = 15.0) -> None:
        """SIGTERM `first` (the router) and wait for it to drain, then the others; kill what outlives its wait."""
        for child in self.children:
            child.start_at = None  # no restarts now
        leading = [c for c in self.children if c.name == first]
        others = [c for c in self.children if c.name != first]
        for group, wait_s in ((leading, drain_s), (others, rest_s)):
            running = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for child in running:
                child.proc.send_signal(signal.SIGTERM)
            deadline = self._clock() + wait_s
            for child in running:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - self._clock()))
                except subprocess.TimeoutExpired:
                    print(f"specfleet serve: {child.name} did not stop within {wait_s:.0f}s of SIGTERM; killing it", file=sys.stderr)
                    child.proc.kill()
                    child.proc.wait()

    def pid_of(self, name: str) -> int | None:
        for child in self.children:
            if child.name == name and child.proc is not None:
                return child.proc.pid
        return None
