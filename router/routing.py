"""Expertise routing: which drafters draft for a request.

Three parts, read top to bottom (kept in one file, about 500 lines, because each reads the one
before it):

1. The prior: a new request's domain. Each drafter declares specialities
   (labels) and a few exemplar texts. By default every specialist scores the
   prompt while prefilling it (its mean log-probability of the prompt's
   tokens, one call in the request's first round, beside the target's
   prefill, while the request decodes plainly) and the best one's speciality is
   the domain: the drafter that predicts the prompt best is the one most
   likely to be accepted on its continuation. `DomainClassifier` is the
   model-free fallback (and the `exemplars` prior): the speciality whose
   exemplars the prompt resembles most (cosine similarity of hashed
   character trigrams and layout shapes, microseconds per prompt).
2. `ExpertiseStore`, the learned state: per (domain, drafter), decayed counts
   of accepted and rejected draft tokens, a Beta posterior on the drafter's
   per-token acceptance in that domain. In process by default; in Redis when a
   URL is configured, so router replicas learn together and a restarted router
   keeps what was learned. If Redis goes away, the store keeps working on its
   local copy and pushes what it learned meanwhile when Redis returns.
3. `DrafterRouter`, the policy. Per request and round it draws a Thompson
   sample of each drafter's acceptance from the domain's posterior plus what
   this request has shown so far (a request whose acceptance drops moves on
   by itself), and takes the best; it adds cooperating drafters for fusion
   when even the best is not confidently good.

Policies for comparison: `fixed` (one drafter for everything), `random`,
`oracle` (the drafter whose speciality is the request's declared domain),
`expertise` (the above).
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from router.lead_tally import LeadTally
from specfleet.config import ROUTING_POLICIES, RoutingConfig

log = logging.getLogger(__name__)

POLICIES = ROUTING_POLICIES


# --- 1. the prior -------------------------------------------------------------------------------------------


FEATURES = 8192  # hashed features of a text's vector

_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters: one "a" in a text's layout
_DIGIT = re.compile(r"\d")
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_LAYOUT_SALT = np.uint64(0x9E3779B97F4A7C15)  # a layout 4-gram hashes apart from a trigram of the same characters


def _mixed(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash of each element (splitmix64's finaliser: every input bit moves every output bit)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    return x ^ (x >> np.uint64(31))


def _gram_hashes(text: str, n: int) -> np.ndarray:
    """A hash of each n characters in a row of `text`, all in numpy (a prompt's vector is on the event loop)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    count = len(codes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    key = codes[:count]
    for j in range(1, n):
        key = _mixed(key) ^ codes[j : j + count]
    return _mixed(key)


def _trigram_vector(text: str, dims: int = FEATURES) -> tuple[np.ndarray, np.ndarray]:
    """A text's unit vector of hashed counts of character trigrams (what words it uses) and of 4-grams of its
    layout, each run of letters one letter and digits folded (indentation, `key: value`, brackets): its nonzero
    features, ascending, and their values."""
    padded = f"  {text}  "
    layout = _DIGIT.sub("0", _LETTERS.sub("a", padded))
    hashes = np.concatenate([_gram_hashes(padded, 3), _gram_hashes(layout, 4) ^ _LAYOUT_SALT])
    counts = np.bincount((hashes % np.uint64(dims)).astype(np.int64), minlength=dims)
    features = np.flatnonzero(counts)
    values = counts[features].astype(np.float64)
    return features, values / (math.sqrt(float(values @ values)) or 1.0)


class DomainClassifier:
    """The speciality of the exemplar most similar to the prompt (nearest neighbour).

    The exemplars' vectors are kept as an inverted index in numpy (for each feature, the exemplars that have it and
    their values), so a prompt costs a gather of the nonzeros it shares with them and one sum, not a pass over every
    exemplar's nonzeros (its cost: docs/benchmarks/exemplar-margin.md)."""

    def __init__(self, exemplars: dict[str, list[str]]):
        self.labels: list[str] = []  # each exemplar's label, by exemplar index
        self._names: list[str] = []  # each label with exemplars, and the row of its first (they are consecutive)
        firsts: list[int] = []
        rows, features, values = [], [], []
        for label, texts in exemplars.items():
            if texts:
                self._names.append(label)
                firsts.append(len(self.labels))
            for text in texts:
                f, v = _trigram_vector(text)
                rows.append(np.full(len(f), len(self.labels), dtype=np.int64))
                features.append(f)
                values.append(v)
                self.labels.append(label)
        every = np.concatenate(features) if features else np.zeros(0, dtype=np.int64)
        order = np.argsort(every, kind="stable")
        self._rows = np.concatenate(rows)[order] if rows else np.zeros(0, dtype=np.int64)
        self._values = np.concatenate(values)[order] if values else np.zeros(0, dtype=np.float64)
        by_feature = every[order]
        # Feature f's nonzeros are entries _starts[f] to _starts[f + 1] - 1.
        self._starts = np.searchsorted(by_feature, np.arange(FEATURES + 1))
        self._firsts = np.asarray(firsts, dtype=np.int64)

    def scores(self, prompt: str) -> dict[str, float]:
        """Each label's best cosine similarity between the prompt and one of its exemplars."""
        if not self.labels:
            return {}
        features, values = _trigram_vector(prompt[-2000:])
        starts, lengths = self._starts[features], self._starts[features + 1] - self._starts[features]
        # The entries of every shared feature, in one index: each feature's run starts where its own entries do.
        offsets = np.cumsum(lengths) - lengths
        entries = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
        weights = self._values[entries] * np.repeat(values, lengths)
        similarity = np.bincount(self._rows[entries], weights=weights, minlength=len(self.labels))
        # A label's exemplars are consecutive rows: its best is the maximum over its run.
        return dict(zip(self._names, np.maximum.reduceat(similarity, self._firsts).tolist()))

    def classify(self, prompt: str) -> str:
        return best_label(self.scores(prompt))

    def sure(self, prompt: str, margin: float) -> str:
        """The prompt's label where its best exemplar beats every other label's by at least `margin`, else ""."""
        return sure_label(self.scores(prompt), margin) if margin > 0 else ""


def best_label(scores: dict[str, float]) -> str:
    """The label of the best score ("" with none)."""
    return max(scores, key=scores.get) if scores else ""


def sure_label(scores: dict[str, float], margin: float) -> str:
    """The best label where it leads every other by at least `margin` (> 0), else ""."""
    ranked = sorted(scores, key=scores.get, reverse=True)
    if not ranked or (len(ranked) > 1 and scores[ranked[0]] - scores[ranked[1]] < margin):
        return ""
    return ranked[0]


# --- 2. the learned state -------------------------------------------------------------------------------------


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

    def get(self, domain: str, drafter: str) -> Evidence:
        with self._lock:
            e = self._local.get((domain, drafter))
            return Evidence(e.accepted, e.rejected) if e else Evidence()

    def add(self, domain: str, drafter: str, accepted: float, rejected: float) -> None:
        with self._lock:
            e = self._local.setdefault((domain, drafter), Evidence())
            e.accepted = e.accepted * self.decay + accepted
            e.rejected = e.rejected * self.decay + rejected

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
                self._local[(domain, drafter)] = evidence

    @property
    def backend(self) -> str:
        return "redis" if self._down_since is None else "memory (redis unavailable)"


# --- 3. the policy -----------------------------------------------------------------------------------------------


# Domains requests may name beyond the drafters' specialities (`DrafterRouter.admits`).
MAX_EXTRA_DOMAINS = 64


@dataclass
class DrafterProfile:
    name: str
    specialities: list[str] = field(default_factory=list)
    # Runs no model (kind ngram): its proposals cost its service no step, so it adds no model to a round.
    model_free: bool = False


@dataclass
class RoutingTuning:
    """The routing's constants, not deployment keys (the deployment's routing keys are
    specfleet.config.RoutingConfig, the router's section the DrafterRouter takes whole)."""

    # Pseudo-counts: the prior for a drafter in its own speciality and elsewhere.
    prior_specialist: tuple[float, float] = (4.0, 1.0)
    prior_other: tuple[float, float] = (1.0, 1.0)
    # The domain's shared evidence counts as at most shared_evidence_cap draft tokens (hits and
    # misses), a prior for each request; each of the request's own tokens counts request_weight
    # times. Their ratio sets how fast a request whose acceptance drops overturns the domain's
    # choice: 16 of its own tokens weigh as much as all of the domain's evidence. Their scale sets
    # how narrow the posteriors get, hence how much the router keeps exploring: the bundled
    # family's specialists beat its general drafter by 0.06-0.17 per-token acceptance, which
    # posteriors of 32 tokens (about 0.08 wide) do not separate, so the router would keep trying
    # the wrong drafter in up to a third of the rounds; at 256 it settles on the specialist within
    # a few dozen requests per domain, and still explores a little, so it notices drift.
    # scripts/routing_convergence.py and docs/benchmarks/routing-convergence.md have the numbers.
    request_weight: float = 16.0
    shared_evidence_cap: float = 256.0


@dataclass
class RequestRouting:
    """What the router knows about one request."""

    domain: str
    evidence: dict[str, Evidence] = field(default_factory=dict)
    # Set while the domain waits for the specialists to score the prompt; the exemplar
    # classifier then runs only if no specialist could (it costs the router real CPU).
    needs_scores: bool = False
    # False once a round decoded the request plainly before any round routed it (the measured check's plain
    # decoding), or its first routed round only remeasured speculating: the exemplars alone place its prompt.
    # Scored then, the prompts that arrived while every round decoded plainly would all be scored in the round
    # that speculates again.
    scorable: bool = True
    prompt: str = ""


class DrafterRouter:
    def __init__(
        self,
        config: RoutingConfig,
        drafters: list[DrafterProfile],
        classifier: DomainClassifier,
        store: ExpertiseStore,
        seed: int = 0,
        tuning: RoutingTuning | None = None,
    ):
        if config.routing_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {config.routing_policy!r}")
        self.config = config  # the router's routing section, replaced whole on reload
        self.tuning = tuning or RoutingTuning()
        self.drafters = {d.name: d for d in drafters}
        # The drafters that run no model: a round's distinct models leave them out.
        self.model_free = frozenset(d.name for d in drafters if d.model_free)
        self.domains = {domain for d in drafters for domain in d.specialities}
        self.extra_domains: set[str] = set()  # named by requests (`admits`), at most MAX_EXTRA_DOMAINS
        self.classifier = classifier
        self.store = store
        self.rng = random.Random(seed)
        # Which drafter the round plans led each domain with (router/lead_tally.py): whether scoring a prompt pays.
        self.leads = LeadTally()

    def admits(self, domain: str) -> bool:
        """Whether a request may name this domain (GenerateRequest.domain): a drafter's speciality, or one of the
        first MAX_EXTRA_DOMAINS others named. Each domain is a label on the router's metrics and a field per drafter
        in the shared Redis hash, so clients must not add them without bound; past the budget a request's domain
        comes from its prompt, as if it named none."""
        if domain in self.domains or domain in self.extra_domains:
            return True
        if len(self.extra_domains) >= MAX_EXTRA_DOMAINS:
            return False
        self.extra_domains.add(domain)
        return True

    def pairs(self) -> list[tuple[str, str]]:
        """Every (domain, drafter) whose evidence the router uses: what it shares with other routers. The domain ""
        is that of requests nothing classifies (drafters without specialities)."""
        return [(domain, drafter) for domain in sorted(self.domains | self.extra_domains | {""}) for drafter in self.drafters]

    def start(self, prompt: str, domain_hint: str = "", drafts: bool = True) -> RequestRouting:
        """What routing knows of a new request. One that never drafts (speculation off) needs no drafter: no
        specialist scores its prompt and no classifier reads it; its domain is the one it names, if any."""
        hint = domain_hint if self.config.use_domain_hint and domain_hint and self.admits(domain_hint) else ""
        if hint or not drafts:
            return RequestRouting(domain=hint)
        if self.config.routing_policy == "expertise" and self.config.domain_prior == "likelihood" and self.scorers():
            return RequestRouting(domain="", needs_scores=True, prompt=prompt)
        return RequestRouting(domain=self.classifier.classify(prompt))

    def scorers(self) -> list[str]:
        """The drafters that score new prompts: those that declare specialities."""
        return [name for name, profile in self.drafters.items() if profile.specialities]

    def place(self, routing: RequestRouting) -> None:
        """Before a request's prompt is scored: where the exemplars place it clearly (or it is not `scorable`, or
        recent rounds led every domain with the same drafter: `LeadTally`), their label is its domain and no
        specialist spends a prefill on it. In the request's first round that routes, not
        at submission, so that a call of many prompts costs the event loop one classification per request admitted,
        not all of them at once."""
        margin, settles = self.config.exemplar_margin, not routing.scorable or not self.leads.domain_matters()
        if margin <= 0 and not settles:
            return  # the specialists score it: no classification to spend
        scores = self.classifier.scores(routing.prompt)  # once: the sure label and the best guess read the same
        sure = sure_label(scores, margin) if margin > 0 else ""
        if sure or settles:
            # Clearly placed, or the exemplars' best guess, however close: scoring may not run, or cannot change the
            # request's lead.
            routing.domain, routing.needs_scores, routing.prompt = sure or best_label(scores), False, ""

    def assign_domain(self, routing: RequestRouting, scores: dict[str, float]) -> None:
        """scores: drafter -> its mean log-probability of the prompt. The best specialist's speciality wins;
        with no scores (drafters unreachable) the exemplar classifier decides."""
        routing.needs_scores = False
        if scores:
            best = max(scores, key=scores.get)
            routing.domain = self.drafters[best].specialities[0]
        else:
            routing.domain = self.classifier.classify(routing.prompt)
        routing.prompt = ""

    def _prior(self, drafter: str, domain: str) -> tuple[float, float]:
        specialist = domain in self.drafters[drafter].specialities
        return self.tuning.prior_specialist if specialist else self.tuning.prior_other

    def posterior(self, routing: RequestRouting, drafter: str) -> tuple[float, float]:
        shared = self.store.get(routing.domain, drafter)
        return self._posterior(routing, drafter, shared.accepted, shared.rejected)

    def _posterior(self, routing: RequestRouting, drafter: str, shared_a: float, shared_r: float) -> tuple[float, float]:
        """The prior, the domain's shared evidence (capped) and the request's own (weighted), summed."""
        prior_a, prior_r = self._prior(drafter, routing.domain)
        scale = min(1.0, self.tuning.shared_evidence_cap / max(1e-9, shared_a + shared_r))
        mine = routing.evidence.get(drafter)
        mine_a, mine_r = (mine.accepted, mine.rejected) if mine is not None else (0.0, 0.0)
        w = self.tuning.request_weight
        return prior_a + scale * shared_a + w * mine_a, prior_r + scale * shared_r + w * mine_r

    def mean(self, routing: RequestRouting, drafter: str) -> float:
        """The drafter's expected per-token acceptance for this request."""
        a, r = self.posterior(routing, drafter)
        return a / (a + r)

    def posteriors(self, routing: RequestRouting) -> dict[str, tuple[float, float]]:
        """Every drafter's posterior for this request, the store read once: what `choose` samples from, for a caller
        that also needs every drafter's mean (a round planned by goodput) to compute them once."""
        shared = self.store.counts(routing.domain, self.drafters)
        return {d: self._posterior(routing, d, a, r) for d, (a, r) in zip(self.drafters, shared)}

    def choose(self, routing: RequestRouting, candidates: bool = False, posteriors: dict | None = None) -> list[str]:
        """The drafters for this round, best first. Expertise routing adds cooperating drafters (up to fusion_width
        in all) while the best is not confidently good (`fusion_below`); with `candidates`, always, as drafters the
        round may add where the cost model says they pay (router/drafter_choice.py `cooperate`). posteriors: this
        request's `posteriors`, where the caller has them."""
        if not self.drafters:
            return []
        policy = self.config.routing_policy
        if policy == "fixed":
            chosen = [self.config.default_drafter or next(iter(self.drafters))]
        elif policy == "random":
            chosen = [self.rng.choice(sorted(self.drafters))]
        elif policy == "oracle":
            experts = [d for d, p in self.drafters.items() if routing.domain in p.specialities]
            chosen = [experts[0] if experts else (self.config.default_drafter or next(iter(self.drafters)))]
        else:
            posteriors = posteriors or self.posteriors(routing)
            samples = {d: self.rng.betavariate(a, r) for d, (a, r) in posteriors.items()}
            ranked = sorted(samples, key=samples.get, reverse=True)
            best_mean = max(a / (a + r) for a, r in posteriors.values())
            width = 1 if best_mean >= self.config.fusion_below and not candidates else self.config.fusion_width
            chosen = ranked[: max(1, width)]
        return chosen

    def observe(self, routing: RequestRouting, outcomes: dict[str, tuple[int, int]]) -> None:
        """outcomes: drafter -> (accepted, rejected) draft tokens this round."""
        for drafter, (accepted, rejected) in outcomes.items():
            mine = routing.evidence.setdefault(drafter, Evidence())
            mine.accepted += accepted
            mine.rejected += rejected
            if self.config.routing_policy == "expertise":
                self.store.add(routing.domain, drafter, accepted, rejected)
