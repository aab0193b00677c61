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

The package: `fields.py` (declared fields: `knob(default, doc, check=...)`, the generic reader
`build` and `check_fields`, `describe`), `services.py` (`ServiceConfig`, what the verifier and
drafter services share, and each one's section), `router.py` (the router's section and its
components' sections), `deployment.py` (security, `Config`, `parse`, `load`, the checks that span
fields), `runtime.py` (devices, exemplar files, replicas' ports, the default config).
`specfleet.config.X` names every one of them.
"""

from __future__ import annotations

import pathlib

from specfleet.config.deployment import Config, SecurityConfig, TLS_CLIENT_AUTH, TlsConfig, load, load_data, parse, port_of, validate
from specfleet.config.fields import Check, ConfigError, at_least, build, check_fields, describe, knob, one_of, required, section
from specfleet.config.router import (
    DOMAIN_PRIORS,
    ROUTING_POLICIES,
    RequestLimitsConfig,
    RouterConfig,
    RoutingConfig,
    SchedulingConfig,
    SpeculationConfig,
    chat_template_text,
)
from specfleet.config.runtime import (
    DEMO_MODELS,
    check_devices,
    default_config,
    effective,
    exemplars_of,
    parse_override,
    replica_ports,
    resolve_device,
    served_model_name,
    set_key,
)
from specfleet.config.services import (
    ATTENTION_MODES,
    DEVICE_PATTERN,
    LINEAR_MODES,
    DraftModelConfig,
    DrafterServiceConfig,
    RayPlacement,
    ServiceConfig,
    VerifierConfig,
)

REPO = pathlib.Path(__file__).resolve().parents[2]

# Ports a service listens on when its config leaves the key unset: on by default, as a user
# expects of `specfleet serve`, yet a second deployment on the machine still starts.
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORTS = {"router": 9460, "verifier": 9461, "drafter": 9462}


def keys_help() -> str:
    """Every key of the file, with its type, default, what it accepts and what it means."""
    lines = describe(VerifierConfig, "verifier") + describe(DrafterServiceConfig, "drafters[]")
    return "\n".join(lines + describe(RouterConfig, "router") + describe(SecurityConfig, "security"))


__all__ = [
    "ATTENTION_MODES",
    "Check",
    "Config",
    "ConfigError",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_METRICS_PORTS",
    "DEMO_MODELS",
    "DEVICE_PATTERN",
    "LINEAR_MODES",
    "DOMAIN_PRIORS",
    "DraftModelConfig",
    "DrafterServiceConfig",
    "REPO",
    "ROUTING_POLICIES",
    "RayPlacement",
    "RequestLimitsConfig",
    "RouterConfig",
    "RoutingConfig",
    "SchedulingConfig",
    "SecurityConfig",
    "ServiceConfig",
    "SpeculationConfig",
    "TLS_CLIENT_AUTH",
    "TlsConfig",
    "VerifierConfig",
    "at_least",
    "build",
    "chat_template_text",
    "check_devices",
    "check_fields",
    "default_config",
    "describe",
    "effective",
    "exemplars_of",
    "keys_help",
    "knob",
    "load",
    "load_data",
    "one_of",
    "parse",
    "parse_override",
    "port_of",
    "replica_ports",
    "required",
    "resolve_device",
    "served_model_name",
    "section",
    "set_key",
    "validate",
]
