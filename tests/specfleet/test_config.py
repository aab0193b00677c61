"""The deployment config refuses what it cannot run, and every refusal names the key to fix."""

from __future__ import annotations

import copy
import re
import dataclasses

import pytest
import yaml

from specfleet import config as config_mod


def good() -> dict:
    return {
        "verifier": {"model": "models/demo/target"},
        "drafters": [
            {"name": "a", "address": "127.0.0.1:50062", "models": [{"name": "general", "path": "models/demo/drafters/general"}]},
            {"name": "b", "address": "127.0.0.1:50063", "models": [{"name": "code", "path": "models/demo/drafters/code"}]},
        ],
        "router": {"default_drafter": "general"},
    }


def with_(path: str, value) -> dict:
    """good() with the key at a dotted path (list indices as numbers) set to value."""
    data = copy.deepcopy(good())
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


BAD = [
    # (id, config, what the message must name)
    ("unknown section", {**good(), "routers": {}}, "unknown section(s) ['routers']"),
    ("unknown router key", with_("router.max_runing", 8), "router: unknown key(s) ['max_runing']"),
    ("unknown drafter key", with_("drafters.0.adress", "x:1"), "drafters[0]: unknown key(s) ['adress']"),
    ("unknown model key", with_("drafters.0.models.0.pth", "x"), "drafters[0].models[0]: unknown key(s) ['pth']"),
    ("section not a mapping", {**good(), "router": ["port"]}, "router: expected a mapping"),
    ("drafters not a list", {**good(), "drafters": {"name": "a"}}, "drafters: expected a list"),
    ("models not a list", with_("drafters.0.models", "general"), "drafters[0].models: expected a list"),
    ("int as string", with_("router.max_running", "8"), "router.max_running: expected int"),
    ("bool as int", with_("router.port", True), "router.port: expected int"),
    ("float as string", with_("router.rpc_timeout_s", "soon"), "router.rpc_timeout_s: expected float"),
    ("str as number", with_("verifier.dtype", 16), "verifier.dtype: expected str"),
    ("no target model", with_("verifier.model", ""), "verifier.model"),
    ("batch size zero", with_("verifier.max_batch_size", 0), "verifier.max_batch_size: must be at least 1"),
    ("max_running zero", with_("router.max_running", 0), "router.max_running: must be at least 1"),
    ("request bytes zero", with_("router.max_request_bytes", 0), "router.max_request_bytes: must be at least 1"),
    ("call sessions zero", with_("verifier.max_call_sessions", 0), "verifier.max_call_sessions: must be at least 1"),
    ("call tokens as float", with_("drafters.1.max_call_tokens", 1.5), "drafters[1].max_call_tokens: expected int"),
    ("call tokens negative", with_("drafters.1.max_call_tokens", -5), "drafters[1].max_call_tokens: must be at least 0"),
    ("default above limit", with_("router.default_max_tokens", 4096), "router.default_max_tokens"),
    ("draft tokens above max", with_("router.num_draft_tokens", 32), "router.num_draft_tokens"),
    ("service without name", with_("drafters.1.name", ""), "drafters[1].name: required"),
    ("duplicate service", with_("drafters.1.name", "a"), "drafters[1].name: duplicate service name 'a'"),
    ("service without models", with_("drafters.0.models", []), "drafters[0].models: a drafter service needs at least one model"),
    ("model without path", with_("drafters.0.models.0", {"name": "general"}), "drafters[0].models[0]: name and path are required"),
    ("unknown draft kind", with_("drafters.0.models.0.kind", "lookup"), "drafters[0].models[0].kind: must be one of model, ngram, got 'lookup'"),
    ("ngram max zero", with_("drafters.0.models.0.ngram_max", 0), "drafters[0].models[0].ngram_max: must be at least 1"),
    (
        "ngram min above max",
        with_("drafters.0.models.0", {"name": "lookup", "kind": "ngram", "path": "t", "ngram_min": 5}),
        "drafters[0].models[0].ngram_min: must be at most ngram_max (4), got 5",
    ),
    (
        "split drafter service with two models",
        with_("drafters.0", {"name": "a", "tensor_parallel_size": 2, "models": [{"name": "x", "path": "p"}, {"name": "y", "path": "q"}]}),
        "drafters[0].tensor_parallel_size: a drafter service split over ranks hosts one draft model (n-gram ones aside), it has 2 (x, y)",
    ),
    ("tensor parallel size zero", with_("drafters.1.tensor_parallel_size", 0), "drafters[1].tensor_parallel_size: must be at least 1"),
    ("duplicate model", with_("drafters.1.models.0.name", "general"), "drafters[1].models[0].name: draft model 'general' is configured twice"),
    ("negative core", with_("drafters.1.cpus", [-1]), "drafters[1].cpus: a list of core numbers"),
    ("cores not a list", with_("verifier.cpus", 3), "verifier.cpus"),
    ("unknown policy", with_("router.routing_policy", "fastest"), "router.routing_policy: must be one of"),
    ("unknown prior", with_("router.domain_prior", "vibes"), "router.domain_prior"),
    ("fusion width zero", with_("router.fusion_width", 0), "router.fusion_width"),
    ("fusion depth negative", with_("router.fusion_depth", -1), "router.fusion_depth"),
    ("pipeline depth negative", with_("router.pipeline_depth", -1), "router.pipeline_depth: 0 (the router chooses) or at least 1"),
    ("decay zero", with_("router.expertise_decay", 0.0), "router.expertise_decay: must be in (0, 1]"),
    ("decay above one", with_("router.expertise_decay", 1.5), "router.expertise_decay"),
    ("replicas not a list", with_("verifier.replicas", "127.0.0.1:1"), "verifier.replicas: a list of host:port addresses"),
    ("replica without port", with_("verifier.replicas", ["verifier-1"]), "verifier.replicas[0]: address 'verifier-1' must be host:port"),
    ("replica twice", with_("verifier.replicas", ["127.0.0.1:50061"]), "verifier.replicas[0]: 127.0.0.1:50061 is listed twice"),
    ("verifier wait zero", with_("router.verifier_wait_s", 0), "router.verifier_wait_s: must be above 0"),
    ("chat template missing", with_("router.chat_template", "no/such.jinja"), "router.chat_template: must be a chat template (Jinja"),
    ("default drafter not served", with_("router.default_drafter", "prose"), "router.default_drafter: 'prose' is not a configured draft model"),
]


@pytest.mark.parametrize("data,names", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_refused_naming_the_key(data, names):
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.parse(data)
    assert names in str(err.value)


def test_the_good_config_parses():
    """The base of every bad config above is itself accepted, so each refusal is for the one change."""
    config = config_mod.parse(good())
    assert [s.name for s in config.drafters] == ["a", "b"] and config.router.routing.default_drafter == "general"


def test_a_split_drafter_service_hosts_an_ngram_drafter_beside_its_model():
    models = [{"name": "general", "path": "models/demo/drafters/general"}, {"name": "lookup", "kind": "ngram", "path": "models/demo/target"}]
    config = config_mod.parse(with_("drafters.0", {"name": "a", "tensor_parallel_size": 2, "models": models}))
    assert config.drafters[0].tensor_parallel_size == 2 and config.drafters[0].model_options()["tensor_parallel_size"] == 2


def test_config_file_problems_name_the_file(tmp_path):
    with pytest.raises(config_mod.ConfigError, match="does not exist"):
        config_mod.load(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("router: {port: [\n")
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.load(broken)
    assert str(broken) in str(err.value) and "not valid YAML" in str(err.value)
    listed = tmp_path / "list.yaml"
    listed.write_text("- verifier\n")
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.load(listed)
    assert str(listed) in str(err.value) and "mapping at the top level" in str(err.value)


# --- declared fields: one doc, one check, one default per knob; the router's keys flat in YAML, grouped in code ---


def all_sections() -> list[type]:
    return [
        config_mod.VerifierConfig,
        config_mod.DrafterServiceConfig,
        config_mod.DraftModelConfig,
        config_mod.RayPlacement,
        config_mod.RouterConfig,
        config_mod.RequestLimitsConfig,
        config_mod.SchedulingConfig,
        config_mod.RoutingConfig,
        config_mod.SpeculationConfig,
        config_mod.SecurityConfig,
        config_mod.TlsConfig,
    ]


def test_every_knob_declares_what_it_means():
    for cls in all_sections():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"


def test_a_knobs_doc_and_check_are_declared_once_and_listed():
    """The check on the field is what refuses a bad value, and what the key listing says it accepts."""
    (width,) = [f for f in dataclasses.fields(config_mod.RoutingConfig) if f.name == "fusion_width"]
    check = width.metadata["check"]
    assert check(1) is None and check(0) == "must be at least 1, got 0"
    listing = config_mod.keys_help()
    line = next(line for line in listing.splitlines() if line.startswith("router.fusion_width "))
    assert width.metadata["doc"] in line and check.doc in line and "default 1" in line
    assert "router.routing.fusion_width" not in listing  # documented as the file spells it
    assert "drafters[].models.name" in listing and "verifier.ray.num_gpus" in listing and "security.tls.client_auth" in listing


def test_the_services_share_their_common_fields():
    shared = {f.name for f in dataclasses.fields(config_mod.ServiceConfig)}
    assert {"device", "dtype", "threads", "cpus", "address", "replicas", "metrics_port", "max_call_sessions", "ray"} <= shared
    for cls in (config_mod.VerifierConfig, config_mod.DrafterServiceConfig):
        assert issubclass(cls, config_mod.ServiceConfig)
        metadata = {f.name: f.metadata for f in dataclasses.fields(cls)}
        # the same declaration, not a copy: a drafter service's own default address keeps the base's doc and check
        assert all(metadata[f.name] is f.metadata or metadata[f.name] == f.metadata for f in dataclasses.fields(config_mod.ServiceConfig))
    assert config_mod.DrafterServiceConfig().address != config_mod.VerifierConfig().address
    assert config_mod.DrafterServiceConfig().max_cache_mb == 512.0 and config_mod.VerifierConfig().max_cache_mb == 1024.0


@pytest.mark.parametrize(
    "router, message",
    [
        ({"fusion_width": 0}, "router.fusion_width: must be at least 1, got 0"),
        ({"routing": {"fusion_width": 0}}, "router.routing.fusion_width: must be at least 1, got 0"),
        ({"routing": {"fusion_wdth": 2}}, "router.routing: unknown key(s) ['fusion_wdth']"),
        ({"routing": 3}, "router.routing: expected a mapping"),
        ({"speculation": {"verify_base_ms": "fast"}}, "router.speculation.verify_base_ms: expected float, got 'fast'"),
        ({"verify_base_ms": -1}, "router.verify_base_ms: must be at least 0, got -1.0"),
        ({"metrics_port": -1}, "router.metrics_port: expected a port number"),
        ({"http_port": "8000"}, "router.http_port: expected int or null"),
        ({"max_queued": -1}, "router.max_queued: must be at least 0"),
        ({"remeasure_every": -1}, "router.remeasure_every: must be at least 0, got -1"),
    ],
)
def test_a_router_key_is_named_as_the_file_spells_it(router, message):
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.parse(with_("router", {**good()["router"], **router}))
    assert message in str(err.value)


def test_flat_and_nested_router_keys_are_one_config_and_the_file_stays_flat():
    flat = config_mod.parse(with_("router", {"default_drafter": "general", "fusion_width": 2, "max_running": 8, "pin_cost_model": True}))
    nested = config_mod.parse(
        with_(
            "router",
            {
                "routing": {"default_drafter": "general", "fusion_width": 2},
                "scheduling": {"max_running": 8},
                "speculation": {"pin_cost_model": True},
            },
        )
    )
    assert flat == nested
    assert (flat.router.routing.fusion_width, flat.router.scheduling.max_running, flat.router.speculation.pin_cost_model) == (2, 8, True)
    written = yaml.safe_load(flat.to_yaml())
    assert written["router"]["fusion_width"] == 2 and not {"routing", "scheduling", "speculation", "requests"} & set(written["router"])
    assert config_mod.parse(written) == flat


def test_one_default_per_knob():
    """The router's components start from their section's defaults, not copies of them."""
    from router.cost_model import CostModel
    from router.speculation import SpeculationController

    assert CostModel() == CostModel.configured(config_mod.SpeculationConfig())
    controller = SpeculationController(CostModel())
    assert controller.adaptive is config_mod.SpeculationConfig().adaptive_speculation
    assert controller.stop_below == config_mod.SpeculationConfig().stop_below_confidence


# --- what `specfleet serve` runs: a file that changes a few keys of the default, and --set ---


def test_a_file_that_names_no_target_or_drafters_changes_the_default_config(tmp_path):
    default = config_mod.default_config(tmp_path)
    few = tmp_path / "few.yaml"
    few.write_text("router: {http_port: 8100, max_running: 8}\nverifier: {max_wait_ms: 0}\n")
    cfg = config_mod.effective(few, [], tmp_path)
    assert (cfg.router.http_port, cfg.router.scheduling.max_running, cfg.verifier.max_wait_ms) == (8100, 8, 0)
    # Everything else is the default's: its target, drafters and routing.
    assert cfg.verifier.model == default.verifier.model and cfg.drafters == default.drafters
    assert cfg.router.routing == default.router.routing
    # A file that names its target (or its drafters) is a deployment of its own: nothing comes from the default's.
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"verifier": {"model": "t"}, "drafters": [{"name": "d", "models": [{"name": "m", "path": "m"}]}]}))
    cfg = config_mod.effective(own, [], tmp_path)
    assert cfg.verifier.model == "t" and [m.name for m in cfg.drafters[0].models] == ["m"] and cfg.router.routing.default_drafter == ""
    no_target = tmp_path / "no-target.yaml"
    no_target.write_text(yaml.safe_dump({"drafters": [{"name": "d", "models": [{"name": "m", "path": "m"}]}]}))
    with pytest.raises(config_mod.ConfigError, match="verifier.model"):
        config_mod.effective(no_target, [], tmp_path)


def test_set_changes_one_key_after_the_file_and_names_what_is_wrong(tmp_path):
    cfg = config_mod.effective(None, ["router.http_port=8200", "drafters.0.attention=per-session", "router.fusion_width=2"], tmp_path)
    assert (cfg.router.http_port, cfg.drafters[0].attention, cfg.router.routing.fusion_width) == (8200, "per-session", 2)
    few = tmp_path / "few.yaml"
    few.write_text("router: {http_port: 8100}\n")
    assert config_mod.effective(few, ["router.http_port=8300"], tmp_path).router.http_port == 8300
    for bad, says in (
        ("router.http_port", "expected KEY=VALUE"),
        ("drafters.4.attention=per-session", "drafters.4: no such item"),
        ("router.nope=1", "router: unknown key(s) ['nope']"),
        ("router.http_port=[1", "not valid YAML"),
        ("router.fusion_width=0", "router.fusion_width"),
    ):
        with pytest.raises(config_mod.ConfigError, match=re.escape(says)):
            config_mod.effective(None, [bad], tmp_path)
