"""What routing has learned: per (domain, drafter), decayed counts of accepted and rejected draft tokens.

They are a Beta posterior on the drafter's per-token acceptance in that domain (router/routing.py reads them). In
process by default (`ExpertiseStore`); in Redis when a URL is configured (`RedisExpertiseStore`), so router
replicas learn together and a restarted router keeps what was learned. If Redis goes away, the store keeps working
on its local copy and pushes what it learned meanwhile when Redis returns.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Evidence:
    accepted: float = 0.0
    rejected: float = 0.0


class ExpertiseStore:
    """Decayed acceptance counts per (domain, drafter), in process."""

    def __init__(self, decay: float):
        self.decay = decay  # multiplies old evidence at every update, so routing follows drifting traffic
        self._local: dict[tuple[str, str], Evidence] = {}
        self._lock = threading.Lock()
        # Moves whenever the evidence may have: what is computed from it (router/routing.py) is kept until it does.
        self.version = 0

    def get(self, domain: str, drafter: str) -> Evidence:
        with self._lock:
            e = self._local.get((domain, drafter))
            return Evidence(e.accepted, e.rejected) if e else Evidence()

    def add(self, domain: str, drafter: str, accepted: float, rejected: float) -> None:
        with self._lock:
            e = self._local.setdefault((domain, drafter), Evidence())
            e.accepted = e.accepted * self.decay + accepted
            e.rejected = e.rejected * self.decay + rejected
            self.version += 1

    def counts(self, domain: str, drafters) -> list[tuple[float, float]]:
        """(accepted, rejected) of each of these drafters in the domain, read under one lock (a round's plan reads
        every drafter's for every request)."""
        with self._lock:
            found = [self._local.get((domain, drafter)) for drafter in drafters]
        return [(e.accepted, e.rejected) if e else (0.0, 0.0) for e in found]

    def snapshot(self) -> dict[tuple[str, str], Evidence]:
        with self._lock:
            return {k: Evidence(v.accepted, v.rejected) for k, v in self._local.items()}

    def sync(self, pairs: list[tuple[str, str]]) -> None:
        """Exchange the evidence of these (domain, drafter) pairs with other routers; nothing to do in process."""

    @property
    def backend(self) -> str:
        return "memory"


# Decay and add atomically, so concurrent routers never lose each other's updates.
# KEYS[1]: the hash; ARGV: decay, then (field, accepted, rejected) triples.
_REDIS_ADD = """
local d = tonumber(ARGV[1])
for i = 2, #ARGV, 3 do
  local a, r = 0, 0
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if old then
    local sep = string.find(old, ',')
    if sep then
      a = tonumber(string.sub(old, 1, sep - 1)) or 0
      r = tonumber(string.sub(old, sep + 1)) or 0
    end
  end
  -- A value nobody can learn from (written by hand, or corrupted) starts afresh.
  if a ~= a or r ~= r or a < 0 or r < 0 or a == math.huge or r == math.huge then
    a, r = 0, 0
  end
  a = a * d + tonumber(ARGV[i + 1])
  r = r * d + tonumber(ARGV[i + 2])
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.6f,%.6f', a, r))
end
return 1
"""


def _parse_evidence(name: bytes, value: bytes) -> tuple[str, str, Evidence] | None:
    """A Redis field of the shared hash, or None if it is not 'domain\x1fdrafter' -> 'a,r' with finite a, r >= 0.

    Anyone who can write to Redis can write anything: a NaN or infinite count would make
    the Thompson sample loop forever on the event loop, so bad values never get in."""
    try:
        domain, drafter = name.decode().split("\x1f", 1)
        a, r = (float(x) for x in value.decode().split(","))
    except ValueError:
        return None
    if not (math.isfinite(a) and math.isfinite(r) and a >= 0 and r >= 0):
        return None
    return domain, drafter, Evidence(a, r)


def _tls_refused(err: BaseException) -> bool:
    """Whether a connection failed in its TLS handshake (certificate, protocol), not for being away."""
    import ssl

    seen, depth = err, 0
    while seen is not None and depth < 8:
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen):
            return True
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    return False


class RedisAuthError(RuntimeError):
    """Redis refused the router's credentials or its TLS handshake: a configuration mistake, refused at start-up."""


def redacted(url: str) -> str:
    """`url` with its password replaced, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _ = credentials.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


# The shared hash expires this long after the last update any router pushed: a fleet idle for a week starts afresh,
# and a hash nobody uses does not stay in Redis for ever.
EXPERTISE_TTL_S = 7 * 24 * 3600


class RedisExpertiseStore(ExpertiseStore):
    """The same counts, shared through one Redis hash.

    Reads come from the local copy, so routing never waits on Redis. `sync()`
    (the scheduler calls it off the event loop, a few times a second) pushes
    what this router learned and pulls what every router learned. While Redis
    is away the local copy keeps serving and the updates wait; they are pushed
    when it returns.
    """

    def __init__(self, url: str, decay: float, key: str = "specfleet:expertise"):
        """url: redis://[:PASSWORD@]host:port/db, or rediss:// for TLS (redis-py's query options, e.g. ssl_ca_certs=PATH)."""
        super().__init__(decay)
        import redis

        self.url = url
        self.safe_url = redacted(url)
        self.key = key
        self._client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            self._client.ping()
        except redis.AuthenticationError as err:
            raise RedisAuthError(
                f"router.redis_url: Redis at {self.safe_url} refused this router ({err}); put its password in the URL, "
                "redis://:PASSWORD@host:port/db (or redis://USER:PASSWORD@... with ACLs; rediss:// for TLS)"
            ) from None
        except redis.ConnectionError as err:
            if not _tls_refused(err):  # away for now: routing runs on local state, and sync() keeps trying
                log.warning("redis at %s unavailable at start-up (%s); routing continues on local state", self.safe_url, err)
            else:  # a wrong CA or an unencrypted server does not heal by retrying
                raise RedisAuthError(
                    f"router.redis_url: the TLS connection to Redis at {self.safe_url} failed ({err}); with rediss://, "
                    "name the CA that signed its certificate: rediss://host:port/db?ssl_ca_certs=PATH"
                ) from None
        except redis.RedisError as err:  # away for now: routing runs on local state, and sync() keeps trying
            log.warning("redis at %s unavailable at start-up (%s); routing continues on local state", self.safe_url, err)
        self._script = self._client.register_script(_REDIS_ADD)
        self._pending: list[tuple[str, str, float, float]] = []
        self._down_since: float | None = None
        self._warned: set[bytes] = set()

    def add(self, domain: str, drafter: str, accepted: float, rejected: float) -> None:
        super().add(domain, drafter, accepted, rejected)
        with self._lock:
            self._pending.append((domain, drafter, accepted, rejected))

    def sync(self, pairs: list[tuple[str, str]]) -> None:
        """Push what this router learned, then pull the evidence of `pairs` only: whatever else the hash holds (other
        routers' domains, or anything written into it) costs this router neither memory nor time."""
        with self._lock:
            pending, self._pending = self._pending, []
        names = [f"{domain}\x1f{drafter}".encode() for domain, drafter in pairs]
        try:
            # Updates from one round apply one decay each, as they would locally.
            for domain, drafter, accepted, rejected in pending:
                self._script(keys=[self.key], args=[self.decay, f"{domain}\x1f{drafter}", accepted, rejected])
            if pending:
                self._client.expire(self.key, EXPERTISE_TTL_S)
            shared = dict(zip(names, self._client.hmget(self.key, names))) if names else {}
        except Exception as err:
            with self._lock:
                self._pending = pending + self._pending
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("redis at %s unavailable (%s); routing continues on local state", self.safe_url, err)
            return
        if self._down_since is not None:
            log.info("redis at %s is back after %.1fs", self.safe_url, time.monotonic() - self._down_since)
            self._down_since = None
        with self._lock:
            for name, value in shared.items():
                if value is None:
                    continue  # nobody has learned it yet
                parsed = _parse_evidence(name, value)
                if parsed is None:
                    if name not in self._warned:
                        self._warned.add(name)
                        log.warning("redis %s: ignoring field %r = %r; expected 'accepted,rejected', finite and >= 0", self.key, name, value)
                    continue
                domain, drafter, evidence = parsed
                if self._local.get((domain, drafter)) != evidence:
                    self._local[(domain, drafter)] = evidence
                    self.version += 1

    @property
    def backend(self) -> str:
        return "redis" if self._down_since is None else "memory (redis unavailable)"
