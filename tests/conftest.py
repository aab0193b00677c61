"""Fixtures that start real specfleet services (tests/harness.py), and the `e2e` marker on every test under
tests/e2e/ (`pytest -m e2e` runs them, `pytest -m "not e2e"` the rest)."""

from __future__ import annotations

import pathlib

import pytest

from specfleet.random_models import ensure_random_family
from tests.harness import Cluster, cluster_config

E2E = pathlib.Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items):
    for item in items:
        if E2E in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def random_family(tmp_path_factory) -> dict[str, pathlib.Path]:
    return ensure_random_family(tmp_path_factory.mktemp("random-models"))


@pytest.fixture(scope="session")
def cluster(random_family, tmp_path_factory):
    """The default cluster: random target, a drafter that agrees with it part of the time; the verifier in a process
    of its own (the tests that use it pause the router and call the verifier meanwhile), where most other clusters
    run it in the router's (verifier.colocate's default)."""
    config = cluster_config(random_family, verifier={"colocate": False})
    c = Cluster(config, tmp_path_factory.mktemp("cluster"), "default").start()
    yield c
    c.stop()
