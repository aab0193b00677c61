"""The config flows into the router's components as sections, whole: at start-up and on a reload."""

from __future__ import annotations

import asyncio
import types

import yaml

from router import server
from router.request import Limits
from router.rounds import SchedulerConfig
from router.expertise import ExpertiseStore
from router.cost_model import CostModel
from router.speculation import SpeculationController
from specfleet import config as config_mod

MODELS = [{"name": "general", "path": "models/demo/drafters/general"}, {"name": "code", "path": "models/demo/drafters/code"}]


def write(path, **router) -> str:
    data = {"verifier": {"model": "models/demo/target"}, "drafters": [{"name": "a", "models": MODELS}], "router": router}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def started(cfg: config_mod.Config):
    """A front door and scheduler as build() leaves them, without the services."""
    rcfg = cfg.router
    store = ExpertiseStore(0.9)
    context = types.SimpleNamespace(
        config=SchedulerConfig(rcfg.scheduling, 2),
        drafters={"general": object(), "code": object()},
        router=types.SimpleNamespace(store=store),
        controller=SpeculationController(CostModel.configured(rcfg.speculation), rcfg.speculation),
    )
    front_door = types.SimpleNamespace(limits=Limits(rcfg.requests, 100, 1024, 5000), target=None)
    return front_door, types.SimpleNamespace(context=context), store


def test_reload_replaces_each_section_whole_and_keeps_what_was_learned(tmp_path):
    path = write(tmp_path / "a.yaml", default_drafter="general", max_running=4, adaptive_speculation=True, max_tokens_limit=512)
    front_door, scheduler, store = started(config_mod.load(path))
    old = scheduler.context
    old_sections = (old.config.settings, old.controller.settings, front_door.limits.requests)
    cost, measured = old.controller.cost, old.controller.measured
    cost.verify_base = 3.5  # learned since start-up
    old.controller.observe_round(8, 8, 5.0, speculated=False)

    path = write(
        tmp_path / "b.yaml",
        routing_policy="fixed",
        default_drafter="code",
        max_running=9,
        adaptive_speculation=False,
        stop_below_confidence=0.2,
        max_tokens_limit=128,
        default_max_tokens=32,
        fusion_width=2,
    )
    asyncio.run(server.reload(front_door, scheduler, path, over_grpc=False))
    new = config_mod.load(path).router

    shared = scheduler.context
    assert shared.config.settings == new.scheduling and shared.config.settings.max_running == 9
    assert shared.controller.settings == new.speculation and not shared.controller.adaptive and shared.controller.stop_below == 0.2
    assert front_door.limits.requests == new.requests and front_door.limits.requests.max_tokens_limit == 128
    assert shared.router.config == new.routing and shared.router.config.routing_policy == "fixed"
    # whole new objects, not the old ones edited: a reader holding an old section sees the old settings only
    assert all(a is not b for a, b in zip(old_sections, (shared.config.settings, shared.controller.settings, front_door.limits.requests)))
    assert old_sections[0].max_running == 4 and old_sections[2].max_tokens_limit == 512
    # what the router learned stays; what the target dictates stays
    assert shared.controller.cost is cost and cost.verify_base == 3.5 and shared.router.store is store
    assert shared.controller.measured is measured and measured.goodput(8, speculated=False) == 8 / 8 / 5.0
    assert (front_door.limits.vocab_size, front_door.limits.max_context, front_door.limits.max_prompt_chars) == (100, 1024, 5000)
    assert shared.config.pipeline_depth == 2


def test_the_n_gram_drafter_is_routed_as_a_drafter_that_runs_no_model(tmp_path):
    """A `kind: ngram` member is a drafter like the others to routing, one whose steps cost its service no model."""
    path = tmp_path / "c.yaml"
    data = {
        "verifier": {"model": "models/demo/target"},
        "drafters": [{"name": "a", "models": [*MODELS, {"name": "ngram", "kind": "ngram", "path": "models/demo/target"}]}],
    }
    path.write_text(yaml.safe_dump(data))
    router = server.build_drafter_router(config_mod.load(str(path)), ["general", "code", "ngram"])
    assert sorted(router.drafters) == ["code", "general", "ngram"] and router.model_free == {"ngram"}
