"""The deployment configuration: one YAML file describes the verifier, the drafters and the router.

Every service reads the same file and takes its own section, so a multi-node
deployment ships one file everywhere. Unknown keys and bad values are refused
at start-up with the key's path in the message.

    verifier:
      model: models/demo/target
      address: 127.0.0.1:50061      # where the router reaches it; the verifier listens on its port
      replicas: [127.0.0.1:50063]   # optional: more verifiers of the same target
    drafters:
      - name: drafters-a            # one drafter service, hosting one or more draft models
        address: 127.0.0.1:50062
        models:
          - {name: general, path: models/demo/drafters/general}
    router:
      port: 50051

With `specfleet serve --ray`, the verifier and each drafter service run as Ray
actors instead of gRPC servers; their optional `ray` key says what the actor
needs from a node. The `address` keys are then unused, except that the verifier
runs as one actor per address it lists (`verifier.address` and each of
`verifier.replicas`: the same count as over gRPC), each with the verifier's `ray`
placement, named `verifier`, `verifier-1`, ...:

    verifier:
      ray: {num_cpus: 1, num_gpus: 1, resources: {big_gpu: 1}, max_restarts: 3}
    drafters:
      - name: drafters-a
        ray: {num_cpus: 1, label_selector: {specfleet/gpu: small}}
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass, field

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
DEMO_MODELS = REPO / "models" / "demo"


# Ports a service listens on when its config leaves the key unset: on by default, as a user
# expects of `specfleet serve`, yet a second deployment on the machine still starts.
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORTS = {"router": 9460, "verifier": 9461, "drafter": 9462}


class ConfigError(ValueError):
    pass


# cpu, cuda, cuda:N (a GPU by index) or auto (cuda if torch sees one, else cpu).
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|auto")
# specfleet.engine.llama.ATTENTION_MODES, spelled out so that reading a config does not import torch.
ATTENTION_MODES = ("auto", "per-session", "batched")
# security.tls.client_auth: which servers require a client certificate.
TLS_CLIENT_AUTH = ("internal", "all", "none")


@dataclass
class RayPlacement:
    """Where a service's Ray actor may run and how Ray treats it (`specfleet serve --ray`)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Custom node resources, e.g. {big_gpu: 1}: declared by `ray start --resources`, consumed by the actor.
    resources: dict[str, float] = field(default_factory=dict)
    # Node labels the actor needs, e.g. {ray.io/accelerator-type: H100} (`ray start --labels`).
    label_selector: dict[str, str] = field(default_factory=dict)
    # Restarts after the actor's process or node dies (-1: without limit); each restart reloads the model.
    max_restarts: int = 3
    # Ray's memory reservation for the actor in MB (0: none); the scheduler uses it for placement only.
    memory_mb: float = 0.0


@dataclass
class VerifierConfig:
    model: str = ""
    address: str = "127.0.0.1:50061"
    # More replicas of this verifier (same model and settings), by address. The router spreads new
    # requests over all of them and moves a dead replica's requests to live ones; `specfleet serve`
    # starts one process per address (replica N exports metrics on metrics_port + N when it is set).
    replicas: list[str] = field(default_factory=list)
    # Where the model runs: cpu, cuda, cuda:N, or auto (cuda if torch sees one, else cpu).
    device: str = "cpu"
    dtype: str = "float32"
    # Attention of a forward pass: batched (one call per layer for the whole batch), per-session (one
    # call per session and layer) or auto: batched on a GPU, and on a CPU when a pass's KV slots are
    # adjacent, else per session (the faster there); docs/benchmarks/engine-forward-pass.md has the numbers.
    attention: str = "auto"
    threads: int = 1
    # Dynamic batching: merge concurrent Verify calls up to this many sessions, waiting at
    # most max_wait_ms after the first arrives. 0 merges only what arrived while the previous
    # batch ran (no added latency for a single stream; measured 4.3 -> 1.3 ms per round).
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    # KV cache memory budget; least recently used caches are dropped (and rebuilt on use) past it.
    max_cache_mb: float = 1024.0
    # Sessions whose token ids are kept at all; past it the oldest are forgotten.
    max_sessions: int = 4096
    # On a CUDA device: [sessions, tokens] buckets whose passes replay CUDA graphs (captured on first
    # use, batched attention), e.g. [[1, 1], [8, 5], [32, 5], [64, 5]]; other shapes and CPUs run eagerly.
    cuda_graph_sizes: list[list[int]] = field(default_factory=list)
    # What one Verify call may carry (specfleet/limits.py): sessions, and context tokens summed over
    # its sessions (kept prefix, new tokens, tree), which bounds its compute and its KV (tokens times
    # the model's KV bytes per token: 32 KB for the demo target, so 1 GB at the default). A larger
    # call is refused before any forward pass; the router splits its calls to fit.
    max_call_sessions: int = 256
    max_call_tokens: int = 32768
    # Cores this service may run on when `specfleet serve` starts it on this machine (CPU
    # affinity; empty: any). Keeps a busy drafter off the verifier's core; under --ray use `ray`.
    cpus: list[int] = field(default_factory=list)
    # Placement as a Ray actor (`specfleet serve --ray`); unset: RayPlacement's defaults.
    ray: RayPlacement | None = None
    # Prometheus metrics at http://host:metrics_port/metrics; 0 turns them off; unset (null):
    # DEFAULT_METRICS_PORTS["verifier"] when that port is free, else off with a warning.
    metrics_port: int | None = None

    def addresses(self) -> list[str]:
        """Every replica's address; the first is `address`."""
        return [self.address, *self.replicas]


@dataclass
class DraftModelConfig:
    name: str = ""
    path: str = ""
    # What this draft model is good at (labels such as code, de, structured), and
    # a few texts typical of it, for routing prompts before anything is learned. Exemplars
    # may also come from a file of JSON lines with a "text" field.
    specialities: list[str] = field(default_factory=list)
    exemplars: list[str] = field(default_factory=list)
    exemplars_file: str = ""


@dataclass
class DrafterServiceConfig:
    name: str = ""
    address: str = "127.0.0.1:50062"
    # More replicas of this service (same models and settings), by address: the router spreads
    # requests over them and moves a dead one's requests on; `specfleet serve` starts one process
    # per address (replica N exports metrics on metrics_port + N when it is set).
    replicas: list[str] = field(default_factory=list)
    models: list[DraftModelConfig] = field(default_factory=list)
    # Where this service's draft models run: cpu, cuda, cuda:N, or auto (see VerifierConfig.device).
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"  # see VerifierConfig.attention
    threads: int = 1
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    max_cache_mb: float = 512.0
    max_sessions: int = 4096
    # What one Draft call may carry (see VerifierConfig.max_call_sessions); drafts count as tokens.
    max_call_sessions: int = 256
    max_call_tokens: int = 32768
    # Entries kept in a sampled proposal's sparse distribution.
    proposal_top_k: int = 16
    # Draft models of one shape draft in one forward pass a step (specfleet/engine/stack.py);
    # false: one pass per model.
    stack_models: bool = True
    # Cores this service may run on when `specfleet serve` starts it on this machine (CPU
    # affinity; empty: any). Keeps a busy drafter off the verifier's core; under --ray use `ray`.
    cpus: list[int] = field(default_factory=list)
    # Placement as a Ray actor (`specfleet serve --ray`); unset: RayPlacement's defaults.
    ray: RayPlacement | None = None
    # Prometheus metrics at http://host:metrics_port/metrics; 0 turns them off; unset (null):
    # DEFAULT_METRICS_PORTS["drafter"] plus the service's index in `drafters` when that port
    # is free, else off with a warning.
    metrics_port: int | None = None

    def addresses(self) -> list[str]:
        """Every replica's address; the first is `address`."""
        return [self.address, *self.replicas]


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
    # Which drafters draft for a request: expertise (learned online), fixed (default_drafter),
    # random, or oracle (the specialist of the request's declared domain).
    routing_policy: str = "expertise"
    default_drafter: str = ""
    # Take GenerateRequest.domain over the prompt classifier's guess (benchmarks turn it off
    # to measure the classifier and the learning alone).
    use_domain_hint: bool = True
    # How a new request's domain is guessed before anything is learned: likelihood (each
    # specialist scores the prompt while prefilling it; the best one's speciality wins) or
    # exemplars (character n-gram similarity to the drafters' exemplar texts, no model call).
    domain_prior: str = "likelihood"
    # Cooperating drafters per request at most (1: no fusion), used when the best drafter's
    # expected acceptance is below fusion_below.
    fusion_width: int = 1
    fusion_below: float = 0.75
    # Draft positions at which the cooperating drafters after the first propose siblings (0: all
    # k). A sibling at position j counts only when the main branch's first j tokens were accepted,
    # so late siblings add little, while each costs a drafting step and a verified row.
    fusion_depth: int = 0
    # Shared routing state: redis://host:port/db, or empty for in-process state.
    redis_url: str = ""
    # Weight left on old routing evidence after each update (follows drifting traffic).
    expertise_decay: float = 0.995
    # Groups of requests drafted and verified alternately (1: no pipelining). 0: the router chooses,
    # 2 when some drafter can compute beside the verifier (another host or device, or enough cores
    # for the verifier's, a drafter's and the router's threads), else 1 (specfleet/placement.py).
    pipeline_depth: int = 0
    # Choose k per request and round from predicted acceptance and load; false: always num_draft_tokens.
    adaptive_speculation: bool = True
    # Drafters stop early once the product of their confidences falls below this (0: never).
    stop_below_confidence: float = 0.0
    # Cost model, in ms: initial guesses, replaced by timed passes at start-up and followed online
    # (router/speculation.py), or fixed as given when pin_cost_model.
    verify_base_ms: float = 8.0
    verify_per_session_ms: float = 0.0
    verify_per_token_ms: float = 0.3
    draft_per_token_ms: float = 1.0
    draft_base_ms: float = 0.0
    pin_cost_model: bool = False
    # The largest request the public gRPC API reads (bytes of the serialized message); gRPC refuses
    # a larger one with RESOURCE_EXHAUSTED before reading it into memory.
    max_request_bytes: int = 4 * 1024 * 1024
    # Requests being generated at once; more wait (RESOURCE_EXHAUSTED past max_queued).
    max_running: int = 64
    max_queued: int = 1024
    # Deadline of each internal RPC (draft and verify calls get shorter ones from the cost model).
    rpc_timeout_s: float = 60.0
    # How long a request waits for a live verifier replica (one restarting, say) before it fails
    # with UNAVAILABLE, counted from its last failed verify call.
    verifier_wait_s: float = 60.0
    # How long start-up waits for the verifier and drafters to become healthy.
    startup_timeout_s: float = 180.0
    # Prometheus metrics at http://host:metrics_port/metrics; 0 turns them off; unset (null):
    # DEFAULT_METRICS_PORTS["router"] when that port is free, else off with a warning.
    metrics_port: int | None = None
    # The OpenAI-compatible HTTP API (router/openai_api.py) at http://host:http_port/v1; 0 turns
    # it off; unset (null): DEFAULT_HTTP_PORT when that port is free, else off with a warning
    # (an explicit port that is taken fails start-up instead).
    http_port: int | None = None
    # The model name clients pass as `model` to the HTTP API; empty: the target directory's name.
    served_model_name: str = ""
    # Cores the router may run on when `specfleet serve` starts it (CPU affinity; empty: any).
    cpus: list[int] = field(default_factory=list)


# --- security: who may call each port (specfleet/security.py applies it) ---


@dataclass
class TlsConfig:
    """PEM files, read by every service at start-up; the same paths on every node, each node its own files."""

    # This process's certificate chain and private key: its servers present them, and the router
    # presents them as its client certificate to the verifier and drafters.
    cert: str = ""
    key: str = ""
    # The CA certificate(s) that sign the peers' certificates: clients check servers against it, and
    # servers that ask for client certificates accept only those it signed.
    ca: str = ""
    # Which servers require a client certificate signed by `ca`: internal (the verifier and drafters:
    # mutual TLS with the router), all (the router's public gRPC, HTTP and every metrics port too), none.
    client_auth: str = "internal"
    # The name the router expects in the verifier's and drafters' certificates, when it is not the
    # host part of their address (empty: that host).
    server_name: str = ""


@dataclass
class SecurityConfig:
    # TLS on every gRPC, HTTP and metrics port; unset: plain text.
    tls: TlsConfig | None = None
    # A file holding the shared secret every internal call carries (`authorization: Bearer SECRET`);
    # empty: $SPECFLEET_INTERNAL_TOKEN when set (`specfleet serve` makes one for its children), else none.
    token_file: str = ""
    # A file holding the secret /metrics asks for (`Authorization: Bearer SECRET`, Prometheus's
    # `authorization: {credentials_file: ...}`); empty: $SPECFLEET_METRICS_TOKEN, else none.
    metrics_token_file: str = ""
    # Let the verifier and drafters listen beyond loopback with neither a token nor mutual TLS
    # (anyone who reaches them could read and change every session); they refuse to otherwise.
    allow_insecure: bool = False


@dataclass
class Config:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafters: list[DrafterServiceConfig] = field(default_factory=list)
    router: RouterConfig = field(default_factory=RouterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

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
        elif key == "ray":
            value = None if value is None else _build(RayPlacement, value, where)
        elif key == "tls":
            value = None if value is None else _build(TlsConfig, value, where)
        elif f.type == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
        elif key in ("resources", "label_selector"):
            want, name = ((int, float), "number") if key == "resources" else (str, "string")
            if not isinstance(value, dict) or any(
                not isinstance(k, str) or not k or not isinstance(v, want) or isinstance(v, bool) for k, v in value.items()
            ):
                raise ConfigError(f"{where}: expected a mapping of names to {name}s, got {value!r}")
            value = {k: float(v) for k, v in value.items()} if key == "resources" else dict(value)
        elif f.type == "int | None":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{where}: expected a port number (0: off) or null (the default), got {value!r}")
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
    unknown = sorted(set(data) - {"verifier", "drafters", "router", "security"})
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {unknown}; allowed: drafters, router, security, verifier")
    drafters = data.get("drafters", [])
    if not isinstance(drafters, list):
        raise ConfigError(f"{source}: drafters: expected a list of drafter services")
    config = Config(
        verifier=_build(VerifierConfig, data.get("verifier", {}), "verifier"),
        drafters=[_build(DrafterServiceConfig, d, f"drafters[{i}]") for i, d in enumerate(drafters)],
        router=_build(RouterConfig, data.get("router", {}), "router"),
        security=_build(SecurityConfig, data.get("security") or {}, "security"),
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
    at_least_one = [
        ("verifier.max_batch_size", v.max_batch_size),
        ("router.max_running", r.max_running),
        ("router.max_request_bytes", r.max_request_bytes),
        ("verifier.max_call_sessions", v.max_call_sessions),
        ("verifier.max_call_tokens", v.max_call_tokens),
    ]
    for i, d in enumerate(config.drafters):
        at_least_one += [(f"drafters[{i}].max_call_sessions", d.max_call_sessions), (f"drafters[{i}].max_call_tokens", d.max_call_tokens)]
    for name, value in at_least_one:
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
    for where, device in [("verifier.device", v.device)] + [(f"drafters[{i}].device", d.device) for i, d in enumerate(config.drafters)]:
        if not DEVICE_PATTERN.fullmatch(device):
            raise ConfigError(f"{where}: must be cpu, cuda, cuda:N or auto, got {device!r}")
    for where, attention in [("verifier.attention", v.attention)] + [(f"drafters[{i}].attention", d.attention) for i, d in enumerate(config.drafters)]:
        if attention not in ATTENTION_MODES:
            raise ConfigError(f"{where}: must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
    _validate_replicas(v, "verifier")
    for i, svc in enumerate(config.drafters):
        _validate_replicas(svc, f"drafters[{i}]")
    if r.verifier_wait_s <= 0:
        raise ConfigError(f"router.verifier_wait_s: must be above 0, got {r.verifier_wait_s}")
    sizes = v.cuda_graph_sizes
    if not isinstance(sizes, list) or not all(
        isinstance(size, list) and len(size) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in size)
        for size in sizes
    ):
        raise ConfigError(f"verifier.cuda_graph_sizes: a list of [sessions, tokens] pairs of positive integers, got {sizes!r}")
    for where, cpus in [("verifier.cpus", v.cpus), ("router.cpus", r.cpus)] + [(f"drafters[{i}].cpus", d.cpus) for i, d in enumerate(config.drafters)]:
        if not isinstance(cpus, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
            raise ConfigError(f"{where}: a list of core numbers (0, 1, ...), got {cpus!r}")
    for where, placement in [("verifier.ray", v.ray)] + [(f"drafters[{i}].ray", d.ray) for i, d in enumerate(config.drafters)]:
        if placement is not None:
            _validate_placement(placement, where)
    policies = ("expertise", "fixed", "random", "oracle")
    if r.routing_policy not in policies:
        raise ConfigError(f"router.routing_policy: must be one of {list(policies)}, got {r.routing_policy!r}")
    if r.domain_prior not in ("likelihood", "exemplars"):
        raise ConfigError(f"router.domain_prior: must be likelihood or exemplars, got {r.domain_prior!r}")
    if r.fusion_width < 1:
        raise ConfigError("router.fusion_width: must be at least 1")
    if r.fusion_depth < 0:
        raise ConfigError(f"router.fusion_depth: 0 (every position) or at least 1, got {r.fusion_depth}")
    if r.pipeline_depth < 0:
        raise ConfigError(f"router.pipeline_depth: 0 (the router chooses) or at least 1, got {r.pipeline_depth}")
    if not 0 < r.expertise_decay <= 1:
        raise ConfigError(f"router.expertise_decay: must be in (0, 1], got {r.expertise_decay}")
    if r.default_drafter and r.default_drafter not in seen_models:
        raise ConfigError(f"router.default_drafter: {r.default_drafter!r} is not a configured draft model {sorted(seen_models)}")
    _validate_security(config.security)


def _validate_security(s: SecurityConfig) -> None:
    """The shape only: the files are read, and checked to fit together, where a service starts (specfleet/security.py)."""
    if s.tls is not None:
        for key in ("cert", "key", "ca"):
            if not getattr(s.tls, key):
                raise ConfigError(f"security.tls.{key}: required with TLS on (a PEM file path)")
        if s.tls.client_auth not in TLS_CLIENT_AUTH:
            raise ConfigError(f"security.tls.client_auth: must be one of {', '.join(TLS_CLIENT_AUTH)}, got {s.tls.client_auth!r}")


def _validate_replicas(service, where: str) -> None:
    if not isinstance(service.replicas, list) or not all(isinstance(a, str) for a in service.replicas):
        raise ConfigError(f"{where}.replicas: a list of host:port addresses, got {service.replicas!r}")
    addresses = service.addresses()
    for i, address in enumerate(addresses):
        key = f"{where}.address" if i == 0 else f"{where}.replicas[{i - 1}]"
        try:
            port_of(address)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        if address in addresses[:i]:
            raise ConfigError(f"{key}: {address} is listed twice; every replica needs its own address")


def resolve_device(device: str, where: str) -> str:
    """The torch device a service's `device` setting names on this machine; raises ConfigError naming the setting.

    Checked where the model loads (and by `specfleet serve` for the services it starts here), not
    when the file is read: one file describes every node, and a router on a CPU node reads the
    verifier's `device: cuda` too.
    """
    if not DEVICE_PATTERN.fullmatch(device):
        raise ConfigError(f"{where}: must be cpu, cuda, cuda:N or auto, got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise ConfigError(f"{where}: {device} was asked for but torch sees no CUDA device (torch.cuda.is_available() is False)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{where}: {device} was asked for but torch sees {torch.cuda.device_count()} CUDA device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def check_devices(config: Config) -> None:
    """Resolve every service's device on this machine (`specfleet serve` runs them all here)."""
    resolve_device(config.verifier.device, "verifier.device")
    for svc in config.drafters:
        resolve_device(svc.device, f"drafters[{svc.name}].device")


def _validate_placement(p: RayPlacement, where: str) -> None:
    for key in ("num_cpus", "num_gpus", "memory_mb"):
        if getattr(p, key) < 0:
            raise ConfigError(f"{where}.{key}: must be at least 0, got {getattr(p, key)}")
    if p.num_gpus > 1 and p.num_gpus != int(p.num_gpus):
        raise ConfigError(f"{where}.num_gpus: a fraction only below 1 (Ray's rule), got {p.num_gpus}")
    for name, amount in p.resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ConfigError(f"{where}.resources.{name}: use num_cpus, num_gpus or memory_mb instead")
        if amount <= 0:
            raise ConfigError(f"{where}.resources.{name}: must be above 0, got {amount}")
    if p.max_restarts < -1:
        raise ConfigError(f"{where}.max_restarts: -1 (no limit) or at least 0, got {p.max_restarts}")


def exemplars_of(model: DraftModelConfig) -> list[str]:
    """The model's exemplar texts: inline ones, then those in exemplars_file."""
    texts = list(model.exemplars)
    if model.exemplars_file:
        import json

        path = pathlib.Path(model.exemplars_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise ConfigError(f"draft model {model.name}: cannot read exemplars_file {path}: {err}") from None
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    texts.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"{path}:{n}: expected a JSON object with a \"text\" field") from None
    return texts


def replica_ports(service, replica: int, where: str) -> tuple[int, int | None]:
    """(gRPC port, metrics_port setting) of replica N of a verifier or drafter service. Replicas on
    one machine need metrics ports of their own: replica N takes metrics_port + N, and none (0)
    when metrics_port is unset, since the default port is the first replica's."""
    addresses = service.addresses()
    if not 0 <= replica < len(addresses):
        raise ConfigError(f"{where}: replica {replica} asked for; the config lists {len(addresses)} (0 to {len(addresses) - 1})")
    metrics_port = service.metrics_port
    if replica:
        metrics_port = metrics_port + replica if metrics_port else 0
    return port_of(addresses[replica]), metrics_port


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
            DraftModelConfig(
                name=d.name,
                path=str(d),
                specialities=[] if d.name == "general" else [d.name],
                exemplars_file=str(d / "exemplars.jsonl") if (d / "exemplars.jsonl").exists() else "",
            )
            for d in sorted(drafter_root.iterdir())
            if (d / "config.json").exists()
        ]
        default = "general" if any(m.name == "general" for m in models) else models[0].name
        # the demo family's specialists (one per language, code, structured text) are routed
        # among by the prompt's domain; two cooperate while the best one's acceptance is low, the
        # second proposing at the first two positions only (docs/benchmarks/fusion-depth.md: 4-10%
        # more tokens/s than at every position on two cores, for 1.5% fewer tokens a verification)
        router = RouterConfig(default_drafter=default, fusion_width=2, fusion_depth=2)
    else:
        from specfleet.random_models import ensure_random_family

        paths = ensure_random_family(work_dir / "random-models")
        target = paths["target"]
        models = [DraftModelConfig(name=n, path=str(paths[n])) for n in ("drafter-noisy", "drafter-copy", "drafter-random")]
        router = RouterConfig(default_drafter="drafter-noisy")
    config = Config(
        verifier=VerifierConfig(model=str(target)),
        drafters=[DrafterServiceConfig(name="drafters", models=models)],
        router=router,
    )
    validate(config)
    return config
