"""Every port refuses callers without credentials: TLS and mutual TLS, the internal token, the API key, Redis's password.

Real processes on loopback: `specfleet serve` with a throwaway CA and certificates made here.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specfleet import config as config_mod
from specfleet import security
from specfleet.serving import CHANNEL_OPTIONS
from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.harness import REPO, Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy

MAX_TOKENS = 24
API_KEY = "test-api-key-0123456789abcdef"
TOKEN = "test-internal-token-0123456789abcdef"
METRICS_TOKEN = "test-metrics-token-0123456789abcdef"


# --- a throwaway PKI ----------------------------------------------------------------------------------------------


def _write_pki(root: pathlib.Path, name: str) -> dict[str, pathlib.Path]:
    """A CA, and one certificate it signs for 127.0.0.1 / localhost usable by servers and clients alike."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(subject: str, issuer: str, public_key):
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        builder(f"{name} CA", f"{name} CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        builder(f"{name} node", f"{name} CA", key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {"ca": root / f"{name}-ca.pem", "cert": root / f"{name}-cert.pem", "key": root / f"{name}-key.pem"}
    files["ca"].write_bytes(ca_cert.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    files["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, pathlib.Path]]:
    root = tmp_path_factory.mktemp("pki")
    # "good" signs the fleet's certificates; "rogue" is another CA with a certificate for the same names.
    return {"good": _write_pki(root, "good"), "rogue": _write_pki(root, "rogue")}


def _secret_file(root: pathlib.Path, name: str, secret: str) -> str:
    path = root / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


# --- a fleet with TLS (client certificates everywhere), the internal token, an API key and a metrics token -------


@pytest.fixture(scope="module")
def secure(random_family, pki, tmp_path_factory):
    work = tmp_path_factory.mktemp("secure")
    good = pki["good"]
    config = cluster_config(random_family, router={"http_port": free_port(), "metrics_port": free_port()})
    config["security"] = {
        "tls": {"cert": str(good["cert"]), "key": str(good["key"]), "ca": str(good["ca"]), "client_auth": "all"},
        "token_file": _secret_file(work, "internal-token", TOKEN),
        "metrics_token_file": _secret_file(work, "metrics-token", METRICS_TOKEN),
    }
    # Whatever the test process carries, this fleet's secret is the file's.
    cluster = Cluster(config, work, "secure", env={"SPECFLEET_API_KEY": API_KEY, "SPECFLEET_INTERNAL_TOKEN": None}).start()
    yield cluster
    cluster.stop()


def _credentials(pki, trust: str = "good", client: str | None = "good") -> grpc.ChannelCredentials:
    read = lambda which, part: pki[which][part].read_bytes()  # noqa: E731
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=read(trust, "ca"))
    return grpc.ssl_channel_credentials(read(trust, "ca"), read(client, "key"), read(client, "cert"))


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def _bearer(secret: str | None) -> tuple:
    return (("authorization", f"Bearer {secret}"),) if secret is not None else ()


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _info_call(service: str, address: str, credentials, secret: str | None):
    """GetInfo on a verifier or drafter service, as a closure for _code."""

    def call():
        with _channel(address, credentials) as channel:
            stub = (verifier_pb2_grpc.VerifierStub if service == "verifier" else drafter_pb2_grpc.DrafterStub)(channel)
            return stub.GetInfo(common_pb2.InfoRequest(), timeout=10, metadata=_bearer(secret))

    return call


@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_internal_services_refuse_callers_without_the_token_or_the_fleets_certificate(secure, pki, service):
    address = secure.verifier if service == "verifier" else secure.drafter
    good = _credentials(pki)
    # The right certificate and token: served.
    assert _code(_info_call(service, address, good, TOKEN)) == grpc.StatusCode.OK
    # No token, or a wrong one, even with the right certificate: UNAUTHENTICATED, saying what to send.
    for secret in (None, "x" * len(TOKEN), TOKEN[:-1], "Bearer " + TOKEN):
        with pytest.raises(grpc.RpcError) as err:
            _info_call(service, address, good, secret)()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, secret
        assert "internal token" in err.value.details() and "security.token_file" in err.value.details()
    # Every method, not only GetInfo: probing, changing or releasing a session needs the token too.
    with _channel(address, good) as channel:
        if service == "verifier":
            stub = verifier_pb2_grpc.VerifierStub(channel)
            probe = lambda: stub.Verify(
                verifier_pb2.VerifyRequest(sessions=[verifier_pb2.VerifySession(sync=common_pb2.SessionSync(session_id="victim", prefix_length=1))]),
                timeout=10,
            )  # noqa: E731
        else:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            probe = lambda: stub.Draft(
                drafter_pb2.DraftRequest(
                    sessions=[drafter_pb2.DraftSession(sync=common_pb2.SessionSync(session_id="victim", prefix_length=1), num_draft_tokens=4)]
                ),
                timeout=10,
            )  # noqa: E731
        for call in (
            probe,
            lambda: stub.ReleaseSessions(common_pb2.ReleaseRequest(session_ids=["victim"]), timeout=10),
            lambda: stub.GetStats(common_pb2.InfoRequest(), timeout=10),
        ):
            assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        # Reflection too; health checks stay open to probes.
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        listing = lambda: list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))  # noqa: E731
        assert _code(listing) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # The token without the fleet's certificate: the TLS handshake fails, nothing is called.
    for credentials in (None, _credentials(pki, client=None), _credentials(pki, client="rogue"), _credentials(pki, trust="rogue", client="rogue")):
        assert _code(_info_call(service, address, credentials, TOKEN)) == grpc.StatusCode.UNAVAILABLE


def test_router_grpc_needs_the_api_key_and_a_client_certificate_and_serves_the_targets_greedy_output(secure, pki, random_family):
    prompt = PROMPTS[0]
    request = greedy_request(prompt, MAX_TOKENS, 4)

    def generate(credentials, key):
        with _channel(secure.router, credentials) as channel:
            return generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120, metadata=_bearer(key))

    for key in (None, "wrong-key", TOKEN):  # the internal token is not an API key
        with pytest.raises(grpc.RpcError) as err:
            generate(_credentials(pki), key)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in err.value.details()
    for credentials in (None, _credentials(pki, client=None), _credentials(pki, client="rogue"), _credentials(pki, trust="rogue", client="rogue")):
        assert _code(lambda: generate(credentials, API_KEY)) == grpc.StatusCode.UNAVAILABLE
    # With both, the router works end to end through TLS to the verifier and drafters: lossless.
    reply = generate(_credentials(pki), API_KEY)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, MAX_TOKENS)
    assert reply.speculation.draft_tokens > 0


def test_the_ready_message_prints_a_generate_command_that_speaks_tls(secure):
    try_line = secure.proc.stdout.readline()
    assert "try: " in try_line and "--ca " in try_line and "--cert " in try_line, try_line
    command = shlex.split(try_line.split("try: ", 1)[1]) + ["--max-tokens", "4"]
    env = {**secure.env, "PYTHONPATH": str(REPO)}
    assert subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, env={**env, "SPECFLEET_API_KEY": ""}).returncode == 1
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_router_http_and_metrics_need_their_keys_and_a_client_certificate(secure, pki):
    good = pki["good"]
    ca, client = str(good["ca"]), (str(good["cert"]), str(good["key"]))
    rogue = (str(pki["rogue"]["cert"]), str(pki["rogue"]["key"]))
    http = f"https://127.0.0.1:{secure.config['router']['http_port']}"
    body = {"model": "target", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    key = {"Authorization": f"Bearer {API_KEY}"}

    reply = requests.post(f"{http}/v1/completions", json=body, headers=key, verify=ca, cert=client, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert requests.post(f"{http}/v1/completions", json=body, headers=headers, verify=ca, cert=client, timeout=30).status_code == 401
    for attempt in (
        lambda: requests.post(f"{http}/v1/completions", json=body, headers=key, verify=ca, timeout=30),  # no client certificate
        lambda: requests.post(f"{http}/v1/completions", json=body, headers=key, verify=ca, cert=rogue, timeout=30),
        lambda: requests.post(f"{http.replace('https', 'http')}/v1/completions", json=body, headers=key, timeout=30),
    ):
        with pytest.raises(requests.exceptions.ConnectionError):
            attempt()

    # The metrics port, and the same metrics beside /v1: each needs the metrics token, not the API key.
    for metrics in (f"https://127.0.0.1:{secure.config['router']['metrics_port']}/metrics", f"{http}/metrics"):
        reply = requests.get(metrics, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, verify=ca, cert=client, timeout=30)
        assert reply.status_code == 200 and "specfleet:num_requests_running" in reply.text, metrics
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, key):
            assert requests.get(metrics, headers=headers, verify=ca, cert=client, timeout=30).status_code == 401, (metrics, headers)
    metrics = f"https://127.0.0.1:{secure.config['router']['metrics_port']}/metrics"
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(metrics, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, verify=ca, timeout=30)


# --- no set-up: `specfleet serve` makes its own internal token ------------------------------------------------------


def test_serve_without_setup_makes_a_token_its_services_demand(random_family, tmp_path):
    # No token in the environment or the config: serve makes one and hands it to its children only.
    cluster = Cluster(cluster_config(random_family), tmp_path, "plain", env={"SPECFLEET_INTERNAL_TOKEN": None}).start()
    try:
        with _channel(cluster.router, None) as channel:
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(PROMPTS[2], MAX_TOKENS, 4), timeout=120)
        assert list(reply.token_ids) == target_greedy(str(random_family["target"]), PROMPTS[2], MAX_TOKENS)
        for service, address in (("verifier", cluster.verifier), ("drafter", cluster.drafter)):
            with pytest.raises(grpc.RpcError) as err:
                _info_call(service, address, None, None)()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "internal token" in err.value.details()
        # The token is in no command line (`ps` shows those to every user).
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "SPECFLEET_INTERNAL_TOKEN" not in ps and "--token" not in ps
    finally:
        cluster.stop()


# --- start-up checks ------------------------------------------------------------------------------------------------


def _minimal_config(random_family, tmp_path, **security_section) -> pathlib.Path:
    config = cluster_config(random_family)
    config["security"] = security_section
    path = tmp_path / "fleet.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("module", ["verifier_service", "drafter_service"])
def test_internal_service_refuses_to_listen_beyond_loopback_without_authentication(random_family, tmp_path, module):
    path = _minimal_config(random_family, tmp_path)
    env = {k: v for k, v in __import__("os").environ.items() if k != "SPECFLEET_INTERNAL_TOKEN"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", module, "--config", str(path), "--host", "0.0.0.0"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert done.returncode != 0
    assert "refusing to listen on 0.0.0.0 without authentication" in done.stderr and "security.token_file" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 60  # refused before loading any model


def test_tls_files_are_checked_at_startup_with_the_key_named(pki, tmp_path):
    good, rogue = pki["good"], pki["rogue"]
    tls = lambda **kw: config_mod.SecurityConfig(
        tls=config_mod.TlsConfig(**{"cert": str(good["cert"]), "key": str(good["key"]), "ca": str(good["ca"]), **kw})
    )  # noqa: E731
    assert security.load(tls()).tls is not None
    with pytest.raises(config_mod.ConfigError, match=r"security\.tls\.cert: cannot read .*missing\.pem"):
        security.load(tls(cert=str(tmp_path / "missing.pem")))
    with pytest.raises(config_mod.ConfigError, match=r"security\.tls\.cert / security\.tls\.key: .* not a PEM certificate and its private key"):
        security.load(tls(key=str(rogue["key"])))  # another certificate's key
    with pytest.raises(config_mod.ConfigError, match=r"security\.tls\.ca: .* not a PEM CA certificate"):
        security.load(tls(ca=str(good["key"])))
    with pytest.raises(config_mod.ConfigError, match=r"security\.tls\.key: required"):
        config_mod.parse({"verifier": {"model": "m"}, "security": {"tls": {"cert": "c", "ca": "a"}}})
    with pytest.raises(config_mod.ConfigError, match=r"security\.tls\.client_auth: must be one of internal, all, none"):
        config_mod.parse({"verifier": {"model": "m"}, "security": {"tls": {"cert": "c", "key": "k", "ca": "a", "client_auth": "yes"}}})
    with pytest.raises(config_mod.ConfigError, match=r"security\.allow_insecure: expected true or false"):
        config_mod.parse({"verifier": {"model": "m"}, "security": {"allow_insecure": "yes"}})
    short = tmp_path / "short-token"
    short.write_text("abc\n")
    with pytest.raises(config_mod.ConfigError, match=r"security\.token_file: the secret must be at least 16"):
        security.load(config_mod.SecurityConfig(token_file=str(short)))
    with pytest.raises(config_mod.ConfigError, match=r"security\.token_file: cannot read"):
        security.load(config_mod.SecurityConfig(token_file=str(tmp_path / "nope")))


def test_serve_refuses_a_missing_certificate_before_starting_anything(random_family, tmp_path, pki):
    good = pki["good"]
    path = _minimal_config(random_family, tmp_path, tls={"cert": str(tmp_path / "absent.pem"), "key": str(good["key"]), "ca": str(good["ca"])})
    done = subprocess.run(
        [sys.executable, "-m", "specfleet.cli", "serve", "--config", str(path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 2
    assert "security.tls.cert: cannot read" in done.stderr and "absent.pem" in done.stderr, done.stderr[-2000:]


# --- Redis with a password ------------------------------------------------------------------------------------------


needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (scripts/ensure-redis)")


@contextlib.contextmanager
def redis_server(args: list[str], **client_options):
    """A redis-server started with these arguments (beside an ephemeral-state default), and a
    redis-py client of it that has seen it answer; the server is killed on exit."""
    import redis

    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(**client_options)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield client
    finally:
        proc.kill()
        proc.wait()


def check_shared(store, client) -> None:
    """What the router learns reaches Redis through this store."""
    store.add("code", "drafter-copy", 5.0, 1.0)
    store.sync([("code", "drafter-copy")])
    assert store.backend == "redis"
    assert client.hgetall("specfleet:expertise") == {b"code\x1fdrafter-copy": b"5.000000,1.000000"}


@needs_redis
def test_redis_with_a_password_works_with_it_and_fails_clearly_without(tmp_path):
    from router.expertise import RedisExpertiseStore, RedisAuthError

    port, password = free_port(), "redis-pass-0123456789"
    with redis_server(["--port", str(port), "--requirepass", password], port=port, password=password) as client:
        store = RedisExpertiseStore(f"redis://:{password}@127.0.0.1:{port}/0", decay=1.0)
        check_shared(store, client)
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong-password@127.0.0.1:{port}/0"):
            with pytest.raises(RedisAuthError) as err:
                RedisExpertiseStore(url, decay=1.0)
            assert "router.redis_url" in str(err.value) and "redis://:PASSWORD@" in str(err.value)
            assert password not in str(err.value)
        # The password never reaches a log line or an error message.
        assert password not in store.safe_url and "***" in store.safe_url


@needs_redis
def test_redis_over_tls_shares_state_and_a_wrong_ca_fails_clearly(pki, tmp_path):
    """rediss:// with the CA that signed Redis's certificate works; another CA stops the router at
    start-up naming router.redis_url and what to set (retrying would never heal it)."""
    from router.expertise import RedisAuthError, RedisExpertiseStore

    good, rogue, port = pki["good"], pki["rogue"], free_port()
    tls = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(good["cert"]),
        "--tls-key-file",
        str(good["key"]),
        "--tls-ca-cert-file",
        str(good["ca"]),
        "--tls-auth-clients",
        "no",
    ]
    with redis_server(tls, port=port, ssl=True, ssl_ca_certs=str(good["ca"])) as client:
        check_shared(RedisExpertiseStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={good['ca']}", decay=1.0), client)
        with pytest.raises(RedisAuthError) as err:
            RedisExpertiseStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={rogue['ca']}", decay=1.0)
        assert "router.redis_url" in str(err.value) and "ssl_ca_certs=PATH" in str(err.value)
        assert "CERTIFICATE_VERIFY_FAILED" in str(err.value)
