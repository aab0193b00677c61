"""Who may call each specfleet port: TLS (mutual between the router and the internal services) and bearer tokens.

One `Security`, built from the config's `security` section at start-up, gives every
server its credentials and interceptors and every client its channel:

- TLS (`security.tls`): every gRPC, HTTP and metrics port serves TLS with `cert`/`key`;
  clients check servers against `ca`. `client_auth` says which servers require a client
  certificate signed by `ca`: `internal` (the verifier and drafters; the router presents
  its own `cert`, so router <-> services is mutual TLS), `all`, or `none`.
- The internal token (`security.token_file`, else $SPECFLEET_INTERNAL_TOKEN): the verifier
  and drafters refuse a call without `authorization: Bearer TOKEN` with UNAUTHENTICATED;
  the router sends it. `specfleet serve` makes a random one for its children when none is set.
- The API key (`--api-key`, $SPECFLEET_API_KEY): the router's public gRPC methods need
  `authorization: Bearer KEY`, as its HTTP API's /v1/* does.
- Health checks (grpc.health.v1) stay open to anyone who can connect, for load balancers
  and Kubernetes probes; reflection needs the token or key, as the services do.

Secrets come from files or the environment, never from a command line (`ps` shows those).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import time
from dataclasses import dataclass

import grpc

from specfleet.config import ConfigError, SecurityConfig
from specfleet.serving import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

INTERNAL_TOKEN_ENV = "SPECFLEET_INTERNAL_TOKEN"
METRICS_TOKEN_ENV = "SPECFLEET_METRICS_TOKEN"
# Methods anyone who can connect may call: probes cannot carry a token.
OPEN_METHODS = ("/grpc.health.v1.Health/",)


class InsecureBinding(RuntimeError):
    """An internal service asked to listen beyond loopback with no way to tell its callers apart."""


@dataclass
class TlsFiles:
    cert_path: str
    key_path: str
    ca_path: str
    cert: bytes
    key: bytes
    ca: bytes
    client_auth: str
    server_name: str


@dataclass
class Security:
    tls: TlsFiles | None = None
    token: str = ""
    metrics_token: str = ""
    allow_insecure: bool = False

    # --- servers ---

    def requires_client_cert(self, public: bool) -> bool:
        return self.tls is not None and self.tls.client_auth in (("all",) if public else ("internal", "all"))

    def server_credentials(self, public: bool = False) -> grpc.ServerCredentials | None:
        """TLS credentials for a gRPC server (public: the router's Generation port), or None for plain text."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca, require_client_auth=self.requires_client_cert(public)
        )

    def server_interceptors(self, public: bool = False, api_key: str = "") -> list[grpc.aio.ServerInterceptor]:
        """An internal service checks the internal token; the router's public port checks the API key."""
        if public:
            return [BearerAuth(api_key, API_KEY_REFUSAL)] if api_key else []
        return [BearerAuth(self.token, INTERNAL_TOKEN_REFUSAL)] if self.token else []

    def ssl_context(self, public: bool = True) -> ssl.SSLContext | None:
        """A server-side TLS context for the HTTP API and metrics ports, or None for plain text."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls.ca_path)
        context.load_cert_chain(self.tls.cert_path, self.tls.key_path)
        context.verify_mode = ssl.CERT_REQUIRED if self.requires_client_cert(public) else ssl.CERT_NONE
        return context

    def uvicorn_tls(self) -> dict:
        """uvicorn.Config's TLS settings for the router's HTTP API."""
        if self.tls is None:
            return {}
        return {
            "ssl_certfile": self.tls.cert_path,
            "ssl_keyfile": self.tls.key_path,
            "ssl_ca_certs": self.tls.ca_path,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.requires_client_cert(public=True) else ssl.CERT_NONE,
        }

    def metrics_options(self) -> dict:
        """specfleet.metrics.serve's TLS and token settings."""
        return {"ssl_context": self.ssl_context(public=True), "token": self.metrics_token}

    def check_binding(self, what: str, host: str, internal: bool, api_key: str = "") -> None:
        """Refuse (internal services) or loudly warn (the router) about a port beyond loopback that anyone may call."""
        if is_loopback(host):
            return
        if internal:
            if self.token or self.requires_client_cert(public=False):
                return
            message = (
                f"{what}: refusing to listen on {host} without authentication: anyone who reaches it could read, change or "
                f"release every request's session. Set security.token_file (or ${INTERNAL_TOKEN_ENV}) to a shared secret, "
                "or security.tls with client_auth internal; or listen on 127.0.0.1; or set security.allow_insecure: true "
                "to accept the risk on a trusted network"
            )
            if not self.allow_insecure:
                raise InsecureBinding(message)
            log.warning("INSECURE: %s listens on %s with neither a token nor mutual TLS (security.allow_insecure is true)", what, host)
            return
        if not api_key and not self.requires_client_cert(public=True):
            log.warning(
                "OPEN TO ANYONE: %s listens on %s with no API key (--api-key or $SPECFLEET_API_KEY) and no client certificates "
                "(security.tls.client_auth: all): every host that reaches it may generate",
                what,
                host,
            )

    # --- clients ---

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a channel to a specfleet server (presenting this process's certificate), or None."""
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert)

    def channel_options(self) -> list[tuple]:
        if self.tls is not None and self.tls.server_name:
            return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.tls.server_name)]
        return list(CHANNEL_OPTIONS)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to an internal service: TLS when configured, plain text otherwise."""
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=self.channel_options())
        return grpc.aio.secure_channel(address, credentials, options=self.channel_options())

    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to an internal service carries."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


API_KEY_REFUSAL = (
    "missing or wrong API key: send the metadata `authorization: Bearer KEY` with the key the router was given "
    "(--api-key or $SPECFLEET_API_KEY; `specfleet generate` sends $SPECFLEET_API_KEY)"
)
INTERNAL_TOKEN_REFUSAL = (
    "missing or wrong internal token: internal calls need the metadata `authorization: Bearer TOKEN` with the secret in "
    f"security.token_file or ${INTERNAL_TOKEN_ENV}; give the router the same secret"
)


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries `authorization: Bearer <secret>` (compared in constant time)."""

    def __init__(self, secret: str, refusal: str):
        self._expected = f"Bearer {secret}".encode()
        self._refusal = refusal
        self._logged_at = 0.0
        self._unlogged = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        given = [v for k, v in (details.invocation_metadata or ()) if k == "authorization"]
        if len(given) == 1 and isinstance(given[0], str) and hmac.compare_digest(given[0].encode(), self._expected):
            return handler
        # One line a second at most: a flood of refused calls must not flood the log.
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            more = f" ({self._unlogged} more refused since the last line)" if self._unlogged else ""
            log.warning("refused %s: %s%s", details.method, "no authorization metadata" if not given else "wrong credentials", more)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        return _refusing(handler, self._refusal)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without reading the request."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached: makes this an async generator, as a streaming handler is

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, 0.0.0.0's spelling aside, may resolve to anything


def _read(path: str, key: str) -> bytes:
    try:
        data = open(path, "rb").read()
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {path}: {err.strerror}") from None
    if not data.strip():
        raise ConfigError(f"{key}: {path} is empty")
    return data


def _secret(path: str, key: str, env: str, environ) -> str:
    if path:
        secret = _read(path, key).decode(errors="replace").strip()
    else:
        secret = environ.get(env, "").strip()
        key = f"${env}"
    if secret and (len(secret) < 16 or not secret.isascii() or not secret.isprintable()):
        raise ConfigError(f"{key}: the secret must be at least 16 printable ASCII characters (e.g. `openssl rand -hex 32`)")
    return secret


def load(cfg: SecurityConfig, environ=os.environ) -> Security:
    """Read and check every file the section names; raises ConfigError naming the key and what to do."""
    tls = None
    if cfg.tls is not None:
        t = cfg.tls
        cert, key, ca = _read(t.cert, "security.tls.cert"), _read(t.key, "security.tls.key"), _read(t.ca, "security.tls.ca")
        # gRPC reports a bad file only when a connection fails; Python's ssl says what is wrong now.
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(t.cert, t.key, password=lambda: b"")  # an encrypted key fails here, never prompts
        except ssl.SSLError as err:
            raise ConfigError(
                f"security.tls.cert / security.tls.key: {t.cert} and {t.key} are not a PEM certificate and its private key ({err.reason or err})"
            ) from None
        try:
            context.load_verify_locations(cafile=t.ca)
        except ssl.SSLError as err:
            raise ConfigError(f"security.tls.ca: {t.ca} is not a PEM CA certificate ({err.reason or err})") from None
        tls = TlsFiles(t.cert, t.key, t.ca, cert, key, ca, t.client_auth, t.server_name)
    return Security(
        tls=tls,
        token=_secret(cfg.token_file, "security.token_file", INTERNAL_TOKEN_ENV, environ),
        metrics_token=_secret(cfg.metrics_token_file, "security.metrics_token_file", METRICS_TOKEN_ENV, environ),
        allow_insecure=cfg.allow_insecure,
    )
