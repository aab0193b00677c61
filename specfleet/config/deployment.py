"""The whole file: the sections, security, reading YAML, and the checks that span fields."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import yaml

from specfleet.config.fields import ConfigError, build, check_fields, flat_dict, knob, one_of, required, section
from specfleet.config.router import RouterConfig
from specfleet.config.services import DrafterServiceConfig, ServiceConfig, VerifierConfig

# security.tls.client_auth: which servers require a client certificate.
TLS_CLIENT_AUTH = ("internal", "all", "none")
PEM_REQUIRED = required("required with TLS on (a PEM file path)")


@dataclass
class TlsConfig:
    """PEM files, read by every service at start-up; the same paths on every node, each node its own files."""

    cert: str = knob("", "this process's certificate chain: its servers present it, the router as its client certificate", check=PEM_REQUIRED)
    key: str = knob("", "the certificate's private key", check=PEM_REQUIRED)
    ca: str = knob("", "the CA certificate(s) that sign the peers' certificates", check=PEM_REQUIRED)
    client_auth: str = knob(
        "internal",
        "which servers require a client certificate signed by `ca`: internal (the verifier "
        "and drafters), all (the router's public ports and every metrics port too), none",
        check=one_of(TLS_CLIENT_AUTH),
    )
    server_name: str = knob("", "the name the router expects in the services' certificates; empty: the host of their address")


@dataclass
class SecurityConfig:
    tls: TlsConfig | None = knob(None, "TLS on every gRPC, HTTP and metrics port; unset: plain text")
    token_file: str = knob(
        "",
        "a file holding the secret every internal call carries (`authorization: Bearer SECRET`); "
        "empty: $SPECFLEET_INTERNAL_TOKEN when set, else none",
    )
    metrics_token_file: str = knob("", "a file holding the secret /metrics asks for; empty: $SPECFLEET_METRICS_TOKEN, else none")
    allow_insecure: bool = knob(False, "let the verifier and drafters listen beyond loopback with neither a token nor mutual TLS")


@dataclass
class Config:
    verifier: VerifierConfig = section(VerifierConfig, "the target model's service")
    drafters: list[DrafterServiceConfig] = field(default_factory=list, metadata={"doc": "the drafter services"})
    router: RouterConfig = section(RouterConfig, "the front door, routing and scheduling")
    security: SecurityConfig = section(SecurityConfig, "who may call each port (specfleet/security.py applies it)")

    def drafter_service(self, name: str) -> DrafterServiceConfig:
        for svc in self.drafters:
            if svc.name == name:
                return svc
        raise ConfigError(f"no drafter service named {name!r}; configured: {[d.name for d in self.drafters]}")

    def draft_models(self) -> dict[str, DrafterServiceConfig]:
        """Draft model name -> the service hosting it."""
        return {m.name: svc for svc in self.drafters for m in svc.models}

    def to_yaml(self) -> str:
        """The config as a file would spell it (the router's keys flat), which `parse` reads back equal."""
        return yaml.safe_dump(flat_dict(self), sort_keys=False)


def parse(data: dict, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    unknown = sorted(set(data) - {"verifier", "drafters", "router", "security"})
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {unknown}; allowed: drafters, router, security, verifier")
    if not isinstance(data.get("drafters", []), list):
        raise ConfigError(f"{source}: drafters: expected a list of drafter services")
    config = Config(
        verifier=build(VerifierConfig, data.get("verifier", {}), "verifier"),
        drafters=[build(DrafterServiceConfig, d, f"drafters[{i}]") for i, d in enumerate(data.get("drafters", []))],
        router=build(RouterConfig, data.get("router", {}), "router"),
        security=build(SecurityConfig, data.get("security") or {}, "security"),
    )
    validate(config)
    return config


def load_data(path: str | pathlib.Path) -> dict:
    """The file's YAML, a mapping (an empty file is an empty one)."""
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def load(path: str | pathlib.Path) -> Config:
    return parse(load_data(path), str(path))


def validate(config: Config) -> None:
    """Every field's declared check, then what spans fields."""
    check_fields(config.verifier, "verifier")
    for i, svc in enumerate(config.drafters):
        check_fields(svc, f"drafters[{i}]")
    check_fields(config.router, "router")
    check_fields(config.security, "security")
    requests = config.router.requests
    if not 1 <= requests.default_max_tokens <= requests.max_tokens_limit:
        raise ConfigError("router.default_max_tokens: must be between 1 and router.max_tokens_limit")
    if not 0 <= requests.num_draft_tokens <= requests.max_draft_tokens:
        raise ConfigError("router.num_draft_tokens: must be between 0 and router.max_draft_tokens")
    seen_services, seen_models = set(), set()
    for i, svc in enumerate(config.drafters):
        if svc.name in seen_services:
            raise ConfigError(f"drafters[{i}].name: duplicate service name {svc.name!r}")
        seen_services.add(svc.name)
        # One split model a process: NCCL's default group, which a split model's collectives use on GPUs, is one.
        split = [m.name for m in svc.models if m.kind == "model"]
        if svc.tensor_parallel_size > 1 and len(split) > 1:
            raise ConfigError(
                f"drafters[{i}].tensor_parallel_size: a drafter service split over ranks hosts one draft model (n-gram ones "
                f"aside), it has {len(split)} ({', '.join(split)}): give the others a service of their own"
            )
        for j, m in enumerate(svc.models):
            if not m.name or not m.path:
                raise ConfigError(f"drafters[{i}].models[{j}]: name and path are required")
            if m.kind == "ngram" and m.ngram_min > m.ngram_max:
                raise ConfigError(f"drafters[{i}].models[{j}].ngram_min: must be at most ngram_max ({m.ngram_max}), got {m.ngram_min}")
            if m.name in seen_models:
                raise ConfigError(f"drafters[{i}].models[{j}].name: draft model {m.name!r} is configured twice")
            seen_models.add(m.name)
    _validate_replicas(config.verifier, "verifier")
    for i, svc in enumerate(config.drafters):
        _validate_replicas(svc, f"drafters[{i}]")
    default = config.router.routing.default_drafter
    if default and default not in seen_models:
        raise ConfigError(f"router.default_drafter: {default!r} is not a configured draft model {sorted(seen_models)}")


def _validate_replicas(service: ServiceConfig, where: str) -> None:
    addresses = service.addresses()
    for i, address in enumerate(addresses):
        key = f"{where}.address" if i == 0 else f"{where}.replicas[{i - 1}]"
        try:
            port_of(address)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        if address in addresses[:i]:
            raise ConfigError(f"{key}: {address} is listed twice; every replica needs its own address")


def port_of(address: str) -> int:
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise ConfigError(f"address {address!r} must be host:port") from None
