"""The deployment configuration: one YAML file describes the verifier, the drafters and the router.

Every service reads the same file and takes its own section, so a multi-node
deployment ships one file everywhere. Unknown keys and bad values are refused
at start-up with the key's path in the message.

    verifier:
      model: models/demo/target
      address: 127.0.0.1:50061      # where the router reaches it; the verifier listens on its port
    drafters:
      - name: drafters-a            # one drafter service, hosting one or more draft models
        address: 127.0.0.1:50062
        models:
          - {name: general, path: models/demo/drafters/general}
    router:
      port: 50051
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
DEMO_MODELS = REPO / "models" / "demo"


class ConfigError(ValueError):
    pass


@dataclass
class VerifierConfig:
    model: str = ""
    address: str = "127.0.0.1:50061"
    dtype: str = "float32"
    threads: int = 1
    # Dynamic batching: merge concurrent Verify calls up to this many sessions,
    # waiting at most this long after the first one arrives.
    max_batch_size: int = 64
    max_wait_ms: float = 2.0
    # KV cache memory budget; least recently used caches are dropped (and rebuilt on use) past it.
    max_cache_mb: float = 1024.0
    # Sessions whose token ids are kept at all; past it the oldest are forgotten.
    max_sessions: int = 4096


@dataclass
class DraftModelConfig:
    name: str = ""
    path: str = ""


@dataclass
class DrafterServiceConfig:
    name: str = ""
    address: str = "127.0.0.1:50062"
    models: list[DraftModelConfig] = field(default_factory=list)
    dtype: str = "float32"
    threads: int = 1
    max_batch_size: int = 64
    max_wait_ms: float = 1.0
    max_cache_mb: float = 512.0
    max_sessions: int = 4096
    # Entries kept in a sampled proposal's sparse distribution.
    proposal_top_k: int = 16


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # Tokenizer for prompts and output text; defaults to the verifier's model directory.
    tokenizer: str = ""
    default_max_tokens: int = 64
    max_tokens_limit: int = 2048
    # Draft tokens per round when the request does not say, and the most a request may ask for.
    num_draft_tokens: int = 4
    max_draft_tokens: int = 16
    # The draft model used for every request (expertise routing replaces this choice).
    default_drafter: str = ""
    # Requests being generated at once; more wait (RESOURCE_EXHAUSTED past max_queued).
    max_running: int = 64
    max_queued: int = 1024
    # Deadline of each internal RPC.
    rpc_timeout_s: float = 60.0
    # How long start-up waits for the verifier and drafters to become healthy.
    startup_timeout_s: float = 180.0


@dataclass
class Config:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafters: list[DrafterServiceConfig] = field(default_factory=list)
    router: RouterConfig = field(default_factory=RouterConfig)

    def drafter_service(self, name: str) -> DrafterServiceConfig:
        for svc in self.drafters:
            if svc.name == name:
                return svc
        raise ConfigError(f"no drafter service named {name!r}; configured: {[d.name for d in self.drafters]}")

    def draft_models(self) -> dict[str, DrafterServiceConfig]:
        """Draft model name -> the service hosting it."""
        return {m.name: svc for svc in self.drafters for m in svc.models}

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)


def _build(cls, data, path: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kwargs = {}
    for key, value in data.items():
        f = known[key]
        where = f"{path}.{key}"
        if key == "models":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: expected a list")
            value = [_build(DraftModelConfig, v, f"{where}[{i}]") for i, v in enumerate(value)]
        elif f.type in ("int", "float", "str"):
            want = {"int": int, "float": (int, float), "str": str}[f.type]
            if not isinstance(value, want) or isinstance(value, bool):
                raise ConfigError(f"{where}: expected {f.type}, got {value!r}")
            value = float(value) if f.type == "float" else value
        kwargs[key] = value
    return cls(**kwargs)


def parse(data: dict, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    unknown = sorted(set(data) - {"verifier", "drafters", "router"})
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {unknown}; allowed: drafters, router, verifier")
    drafters = data.get("drafters", [])
    if not isinstance(drafters, list):
        raise ConfigError(f"{source}: drafters: expected a list of drafter services")
    config = Config(
        verifier=_build(VerifierConfig, data.get("verifier", {}), "verifier"),
        drafters=[_build(DrafterServiceConfig, d, f"drafters[{i}]") for i, d in enumerate(drafters)],
        router=_build(RouterConfig, data.get("router", {}), "router"),
    )
    validate(config)
    return config


def load(path: str | pathlib.Path) -> Config:
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse(data, str(path))


def validate(config: Config) -> None:
    v, r = config.verifier, config.router
    if not v.model:
        raise ConfigError("verifier.model: the target model directory is required")
    for name, value in [("verifier.max_batch_size", v.max_batch_size), ("router.max_running", r.max_running)]:
        if value < 1:
            raise ConfigError(f"{name}: must be at least 1, got {value}")
    if not 1 <= r.default_max_tokens <= r.max_tokens_limit:
        raise ConfigError("router.default_max_tokens: must be between 1 and router.max_tokens_limit")
    if not 0 <= r.num_draft_tokens <= r.max_draft_tokens:
        raise ConfigError("router.num_draft_tokens: must be between 0 and router.max_draft_tokens")
    seen_services, seen_models = set(), set()
    for i, svc in enumerate(config.drafters):
        if not svc.name:
            raise ConfigError(f"drafters[{i}].name: required")
        if svc.name in seen_services:
            raise ConfigError(f"drafters[{i}].name: duplicate service name {svc.name!r}")
        seen_services.add(svc.name)
        if not svc.models:
            raise ConfigError(f"drafters[{i}].models: a drafter service needs at least one model")
        for j, m in enumerate(svc.models):
            if not m.name or not m.path:
                raise ConfigError(f"drafters[{i}].models[{j}]: name and path are required")
            if m.name in seen_models:
                raise ConfigError(f"drafters[{i}].models[{j}].name: draft model {m.name!r} is configured twice")
            seen_models.add(m.name)
    if r.default_drafter and r.default_drafter not in seen_models:
        raise ConfigError(f"router.default_drafter: {r.default_drafter!r} is not a configured draft model {sorted(seen_models)}")


def port_of(address: str) -> int:
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise ConfigError(f"address {address!r} must be host:port") from None


def default_config(work_dir: pathlib.Path) -> Config:
    """No config given: the bundled demo models, else a small random family made on the spot."""
    target = DEMO_MODELS / "target"
    drafter_root = DEMO_MODELS / "drafters"
    if (target / "config.json").exists() and drafter_root.is_dir():
        models = [
            DraftModelConfig(name=d.name, path=str(d))
            for d in sorted(drafter_root.iterdir())
            if (d / "config.json").exists()
        ]
        default = "general" if any(m.name == "general" for m in models) else models[0].name
    else:
        from specfleet.random_models import ensure_random_family

        paths = ensure_random_family(work_dir / "random-models")
        target = paths["target"]
        models = [DraftModelConfig(name=n, path=str(paths[n])) for n in ("drafter-noisy", "drafter-copy", "drafter-random")]
        default = "drafter-noisy"
    config = Config(
        verifier=VerifierConfig(model=str(target)),
        drafters=[DrafterServiceConfig(name="drafters", models=models)],
        router=RouterConfig(default_drafter=default),
    )
    validate(config)
    return config
