"""Fuzzing every RPC of every service with random and mutated messages, sent as raw bytes over real gRPC.

Seeded and bounded: SPECFLEET_FUZZ_MESSAGES messages per service (default 1,500: 60-100 s with
the cluster's start here), SPECFLEET_FUZZ_SEED picks the sequence. Messages are random bytes, valid messages with
bytes flipped, truncated or extended, invalid UTF-8 in string fields, and valid messages with
fields set to what a hostile client would send: negative, NaN and huge numbers, unknown session
ids, absurd prefix lengths, huge repeated fields, mismatched tree shapes. The three services are
fuzzed at once, so bad calls meet good ones in the verifier's and drafters' merged batches.

Afterwards: every process alive, no call hung (each has a deadline; none passed), no INTERNAL or
UNKNOWN status and no traceback in any log, each process's RSS flat over the second half of
the run, and a greedy request equal to the target alone.
"""

from __future__ import annotations

import collections
import math
import os
import random
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specfleet.v1 import common_pb2, drafter_pb2, generation_pb2, verifier_pb2, verifier_pb2_grpc
from tests.harness import INTERNAL_TOKEN, Cluster, cluster_config
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import host_pid

MESSAGES = int(os.environ.get("SPECFLEET_FUZZ_MESSAGES", "1500"))
SEED = int(os.environ.get("SPECFLEET_FUZZ_SEED", "15"))
IN_FLIGHT = 8  # calls outstanding per service at once
CALL_DEADLINE_S = 60.0
# What a correct service may answer to hostile input (NOT_FOUND: a health check of a service that
# does not exist); anything else (INTERNAL, UNKNOWN, UNAVAILABLE:
# a crash, DEADLINE_EXCEEDED: a hang) fails the test.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
# How far each process's RSS at the end of the run may exceed the highest it was at the end of an
# earlier quarter. A leak raises it quarter after quarter; a call carrying a huge repeated field
# raises it for a moment (it is parsed whole), and the allocator may keep some of that, which is why
# the comparison is with the highest earlier level, not the first. What the fuzz may legitimately
# leave behind is bounded by max_sessions (256 at the verifier and the drafter, below): fuzz sessions
# hold a few dozen tokens, one 64-position KV buffer each of the random models (32 KB), 8 MB per
# service at worst; the router keeps nothing per refused or finished request.
RSS_GROWTH_MB = 40

NAN, INF = math.nan, math.inf
WEIRD_INTS = [0, -1, 1, 2, 63, 64, 65, 1023, 1024, 4096, 2**31 - 1, -(2**31)]
WEIRD_FLOATS = [NAN, INF, -INF, -1.0, 0.0, 1e-45, 1e-38, 0.5, 1.0, 2.0, 1e38]
# A string field's bytes become invalid UTF-8 of the same length (so every length prefix stays right).
MARKER = "\u0001FUZZ\u0001"


class Fuzzer:
    def __init__(self, rng: random.Random, vocab: int, draft_model: str):
        self.rng = rng
        self.vocab = vocab
        self.draft_model = draft_model

    # --- values ---

    def int_(self, low: int, high: int) -> int:
        return self.rng.choice(WEIRD_INTS) if self.rng.random() < 0.04 else self.rng.randint(low, high)

    def float_(self, good: float) -> float:
        return self.rng.choice(WEIRD_FLOATS) if self.rng.random() < 0.04 else good

    def ids(self, most: int) -> list[int]:
        if self.rng.random() < 0.02:
            return [self.rng.randrange(self.vocab)] * self.rng.choice([2_000, 5_000])  # a huge repeated field: past every limit
        return [self.int_(0, self.vocab - 1) for _ in range(self.rng.randint(0, most))]

    def session_id(self) -> str:
        r = self.rng.random()
        if r < 0.05:
            return ""
        if r < 0.1:
            return MARKER
        if r < 0.15:
            return "s" * self.rng.choice([1_000, 100_000])
        return f"fuzz-{self.rng.randrange(64)}"  # few ids: later calls find earlier sessions (or their remains)

    def sampling(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.float_(self.rng.choice([0.0, 0.7, 1.0])),
            top_p=self.float_(self.rng.choice([1.0, 0.9])),
            top_k=self.int_(0, 20),
            seed=self.rng.randrange(2**64),
            drafter_invariant=self.rng.random() < 0.3,
        )

    def sync(self) -> common_pb2.SessionSync:
        prefix = 0 if self.rng.random() < 0.6 else self.int_(0, 40)
        ids = self.ids(12)
        if prefix == 0 and not ids and self.rng.random() < 0.8:
            ids = [self.rng.randrange(self.vocab)]
        return common_pb2.SessionSync(session_id=self.session_id(), prefix_length=prefix, new_token_ids=ids)

    def tree(self) -> verifier_pb2.TokenTree:
        n = self.rng.randint(0, 5)
        tokens = [self.int_(0, self.vocab - 1) for _ in range(n)]
        parents = [self.int_(-1, i - 1) for i in range(n)]
        proposals = []
        for _ in range(n):
            k = self.rng.randint(1, 3)
            probs = [self.float_(1.0 / k) for _ in range(k)]
            proposals.append(common_pb2.SparseDistribution(token_ids=[self.int_(0, self.vocab - 1) for _ in range(k)], probs=probs))
        if self.rng.random() < 0.1:  # shapes that do not match
            (parents.append if self.rng.random() < 0.5 else tokens.append)(0)
        return verifier_pb2.TokenTree(token_ids=tokens, parents=parents, proposals=proposals)

    def repeated(self, make, most: int) -> list:
        if self.rng.random() < 0.03:
            return [make()] * self.rng.choice([100, 300])  # one session many times over
        return [make() for _ in range(self.rng.randint(0, most))]

    # --- messages of each method ---

    def verify(self):
        def session():
            return verifier_pb2.VerifySession(sync=self.sync(), tree=self.tree(), sampling=self.sampling())

        return verifier_pb2.VerifyRequest(sessions=self.repeated(session, 4))

    def draft(self):
        def session():
            return drafter_pb2.DraftSession(
                sync=self.sync(),
                model=self.draft_model if self.rng.random() < 0.85 else self.rng.choice(["", "nope", MARKER]),
                num_draft_tokens=self.int_(0, 6),
                sampling=self.sampling(),
                stop_below_confidence=self.float_(self.rng.choice([0.0, 0.3])),
                score_context=self.rng.random() < 0.3,
                lockstep_group=self.rng.choice(["", "", "g1", "g2", MARKER]),
            )

        return drafter_pb2.DraftRequest(sessions=self.repeated(session, 4))

    def release(self):
        return common_pb2.ReleaseRequest(session_ids=self.repeated(self.session_id, 3), keep_tokens=self.rng.random() < 0.5)

    def info(self):
        return common_pb2.InfoRequest()

    def health(self):
        return health_pb2.HealthCheckRequest(service=self.rng.choice(["", MARKER, "specfleet.v1.Nope"]))

    def generate(self):
        request = generation_pb2.GenerateRequest(temperature=self.float_(self.rng.choice([0.0, 0.8])), top_k=self.int_(0, 8))
        if self.rng.random() < 0.8:
            request.prompt = self.rng.choice(PROMPTS + [MARKER, "x" * 5_000])
        if self.rng.random() < 0.25:
            request.prompt_token_ids.extend(self.ids(8))
        if self.rng.random() < 0.9:
            request.max_tokens = self.int_(1, 6)
        if self.rng.random() < 0.5:
            request.top_p = self.float_(0.9)
        if self.rng.random() < 0.3:
            request.seed = self.rng.randrange(2**64)
        if self.rng.random() < 0.2:
            request.stop.extend(self.rng.choice([[""], ["\n"], [MARKER], ["a"] * 40]))
        if self.rng.random() < 0.2:
            request.request_id = self.rng.choice(["r1", "", MARKER, "a\nb", "i" * 500])
        if self.rng.random() < 0.2:
            request.domain = self.rng.choice(["code", MARKER, "d" * 300])
        if self.rng.random() < 0.5:
            request.speculation.max_draft_tokens = self.int_(0, 4)
            request.speculation.disabled = self.rng.random() < 0.2
        if self.rng.random() < 0.3:
            request.stop_at_eos = self.rng.random() < 0.5
        return request

    # --- bytes on the wire ---

    def wire(self, make) -> bytes:
        """Random bytes, or a message made by `make`, possibly with its bytes damaged."""
        r = self.rng.random()
        if r < 0.2:
            return self.rng.randbytes(self.rng.choice([1, 2, 5, 16, 100, 4_000]))
        data = bytearray(make().SerializeToString())
        # Invalid UTF-8 wherever a string field holds the marker.
        marker = MARKER.encode()
        data = bytearray(bytes(data).replace(marker, b"\xff\xfe" + b"\xc0" * (len(marker) - 2)))
        if r < 0.45 and data:
            how = self.rng.randrange(3)
            if how == 0:
                for _ in range(self.rng.randint(1, 4)):
                    data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            elif how == 1:
                del data[self.rng.randrange(len(data)) :]
            else:
                data += self.rng.randbytes(self.rng.randint(1, 16))
        return bytes(data)


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)


def fuzz_service(address: str, methods: list[tuple[str, bool, object]], fuzzer: Fuzzer, count: int, codes: collections.Counter, lock):
    """Send `count` messages to `address`, IN_FLIGHT at a time, round-robin over its methods."""
    with grpc.insecure_channel(address) as channel:
        callables = [
            (
                channel.unary_stream(m, request_serializer=None, response_deserializer=None)
                if streaming
                else channel.unary_unary(m, request_serializer=None, response_deserializer=None),
                m,
                streaming,
                make,
            )
            for m, streaming, make in methods
        ]
        pending: collections.deque = collections.deque()

        def settle(entry):
            method, streaming, call = entry
            try:
                if streaming:
                    for _ in call:
                        pass
                    code = call.code()
                else:
                    call.result()
                    code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code = err.code()
                if code not in ALLOWED:
                    print(f"{method}: {code.name}: {err.details()}")
            with lock:
                codes[(method, code)] += 1

        for i in range(count):
            call_fn, method, streaming, make = callables[i % len(callables)]
            raw = fuzzer.wire(make)
            # With the internal token: the fuzz plays a caller that got past authentication (the worst case).
            metadata = [("authorization", f"Bearer {INTERNAL_TOKEN}")]
            call = (
                call_fn(raw, timeout=CALL_DEADLINE_S, metadata=metadata)
                if streaming
                else call_fn.future(raw, timeout=CALL_DEADLINE_S, metadata=metadata)
            )
            pending.append((method, streaming, call))
            if len(pending) >= IN_FLIGHT:
                settle(pending.popleft())
        while pending:
            settle(pending.popleft())


@pytest.fixture(scope="module")
def fuzz_cluster(random_family, tmp_path_factory):
    config = cluster_config(
        random_family,
        verifier={"max_sessions": 256},
        drafter_service={"max_sessions": 256},
        # Valid Generate calls stay short: the fuzz is about input, not throughput.
        router={"max_tokens_limit": 6, "default_max_tokens": 4},
    )
    cluster = Cluster(config, tmp_path_factory.mktemp("fuzz"), "fuzz").start()
    yield cluster
    cluster.stop()


def test_fuzz_every_rpc(fuzz_cluster, random_family):
    cluster = fuzz_cluster
    with cluster.channel(cluster.verifier) as channel:
        vocab = verifier_pb2_grpc.VerifierStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=30).vocab_size
    model = cluster.config["drafters"][0]["models"][0]["name"]
    internal = lambda f, service: [  # noqa: E731
        (f"/specfleet.v1.{service}/ReleaseSessions", False, f.release),
        (f"/specfleet.v1.{service}/GetInfo", False, f.info),
        (f"/specfleet.v1.{service}/GetStats", False, f.info),
        ("/grpc.health.v1.Health/Check", False, f.health),
    ]
    fuzzers = {name: Fuzzer(random.Random(f"{SEED}-{name}"), vocab, model) for name in ("router", "verifier", "drafter")}
    targets = {
        "router": (
            cluster.router,
            [
                ("/specfleet.v1.Generation/Generate", False, fuzzers["router"].generate),
                ("/specfleet.v1.Generation/GenerateStream", True, fuzzers["router"].generate),
                ("/grpc.health.v1.Health/Check", False, fuzzers["router"].health),
            ],
        ),
        "verifier": (
            cluster.verifier,
            [("/specfleet.v1.Verifier/Verify", False, fuzzers["verifier"].verify)] * 3 + internal(fuzzers["verifier"], "Verifier"),
        ),
        "drafter": (
            cluster.drafter,
            [("/specfleet.v1.Drafter/Draft", False, fuzzers["drafter"].draft)] * 3 + internal(fuzzers["drafter"], "Drafter"),
        ),
    }
    pids = {name: host_pid(cluster, name) for name in targets}
    codes: collections.Counter = collections.Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run_part(count: int) -> None:
        """Fuzz `count` messages per service, the services at once."""

        def worker(name):
            try:
                address, methods = targets[name]
                fuzz_service(address, methods, fuzzers[name], count, codes, lock)
            except BaseException as err:  # reported below; a thread's exception is otherwise lost
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(name,)) for name in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    rss = {name: [] for name in pids}  # MB after each quarter of the run
    for quarter in range(4):
        run_part(MESSAGES // 4 + (MESSAGES % 4 if quarter == 3 else 0))
        for name, pid in pids.items():
            rss[name].append(round(rss_mb(pid), 1))

    print(f"fuzz: {MESSAGES} messages per service, seed {SEED}; RSS MB after each quarter {rss}")
    for (method, code), n in sorted(codes.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
        print(f"  {method} {code.name}: {n}")
    bad = {key: n for key, n in codes.items() if key[1] not in ALLOWED}
    assert not bad, f"statuses a hostile client must never see: {bad}"
    assert sum(codes.values()) == 3 * MESSAGES
    for name, pid in pids.items():
        assert os.path.exists(f"/proc/{pid}"), f"the {name} died"
        assert rss[name][-1] - max(rss[name][:-1]) <= RSS_GROWTH_MB, f"{name}: RSS after each quarter {rss[name]} MB"
    log = cluster.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 : log.index("Traceback") + 3000]
    assert "refused an undecodable request" in log  # the damaged messages reached the decoding path

    prompt = PROMPTS[0]
    with cluster.channel() as channel:
        reply = channel.unary_unary(
            "/specfleet.v1.Generation/Generate",
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )(greedy_request(prompt, 6, 3, stop_at_eos=False), timeout=120)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 6)
