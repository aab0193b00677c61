"""What reads a config beyond its file: devices on this machine, exemplar files, replicas' ports, the default config."""

from __future__ import annotations

import pathlib

from specfleet.config.deployment import Config, load_data, parse, port_of, validate
from specfleet.config.fields import ConfigError, flat_dict
from specfleet.config.router import RouterConfig, RoutingConfig
from specfleet.config.services import DEVICE_PATTERN, DraftModelConfig, DrafterServiceConfig, ServiceConfig, VerifierConfig

DEMO_MODELS = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo"


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
        raise ConfigError(
            f"{where}: {device} was asked for but torch sees {torch.cuda.device_count()} CUDA device(s) "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
        )
    return device


def check_devices(config: Config) -> None:
    """Resolve every service's device on this machine (`specfleet serve` runs them all here)."""
    resolve_device(config.verifier.device, "verifier.device")
    for svc in config.drafters:
        resolve_device(svc.device, f"drafters[{svc.name}].device")


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
                    raise ConfigError(f'{path}:{n}: expected a JSON object with a "text" field') from None
    return texts


def replica_ports(service: ServiceConfig, replica: int, where: str) -> tuple[int, int | None]:
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
        # The model-free n-gram drafter beside them: it costs the service no model step, and where the context
        # repeats itself (code, structured text) it leads or helps.
        models.append(DraftModelConfig(name="ngram", kind="ngram", path=str(target)))
        # The demo family's specialists (one per language, code, structured text) are routed among by the
        # prompt's domain; a second drafter helps a request, its first two positions, where the cost model says
        # the tokens it adds pay for it (router/drafter_choice.py; docs/benchmarks/heldout-default.md)
        router = RouterConfig(routing=RoutingConfig(default_drafter=default, fusion_width=2, fusion_depth=2))
    else:
        from specfleet.random_models import ensure_random_family

        paths = ensure_random_family(work_dir / "random-models")
        target = paths["target"]
        models = [DraftModelConfig(name=n, path=str(paths[n])) for n in ("drafter-noisy", "drafter-copy", "drafter-random")]
        router = RouterConfig(routing=RoutingConfig(default_drafter="drafter-noisy"))
    config = Config(
        verifier=VerifierConfig(model=str(target)),
        drafters=[DrafterServiceConfig(name="drafters", models=models)],
        router=router,
    )
    validate(config)
    return config


def served_model_name(cfg) -> str:
    """The model's name to clients (/v1/models, the metrics' model_name): router.served_model_name, else the target's directory name."""
    return cfg.router.served_model_name or pathlib.Path(cfg.verifier.model).name


def effective(path: str | pathlib.Path | None, overrides: list[str], work_dir: pathlib.Path) -> Config:
    """What `specfleet serve` runs: the file at `path` (none: the default config), then each `--set KEY=VALUE`.

    A file that names no target (`verifier.model`) and no drafters starts from the default config: its keys
    replace the default's one by one (`router: {http_port: 8100}` alone serves the demo family on port 8100).
    A file that names either describes a deployment of its own, and the defaults are each key's own."""
    data = load_data(path) if path else {}
    own = "drafters" in data or "model" in (data.get("verifier") or {})
    if not own:
        base = flat_dict(default_config(work_dir))
        for section in ("verifier", "router", "security"):
            if data.get(section) is not None and not isinstance(data[section], dict):
                raise ConfigError(f"{path}: {section}: expected a mapping")
            base[section] = {**base.get(section, {}), **(data.get(section) or {})}
        data = {**data, **base}
    for item in overrides:
        key, value = parse_override(item)
        set_key(data, key, value)
    return parse(data, str(path) if path else "the default config")


def parse_override(item: str) -> tuple[str, object]:
    """KEY=VALUE, VALUE read as YAML (`router.http_port=8100`, `drafters.0.attention=per-session`)."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, such as router.http_port=8100")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key.strip()}: the value is not valid YAML: {err}") from None


def set_key(data: dict, key: str, value) -> None:
    """Set a dotted key in the config's YAML form: sections' keys by name, list items by index (drafters.0.name)."""
    node, parts = data, key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {where}: no such item (the list has {len(node)})")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[:i])} is not a section")
        if last:
            node[part] = value
        else:
            node = node[part] if isinstance(node, list) else node.setdefault(part, {})
