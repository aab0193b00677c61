"""deploy/: every manifest is valid YAML, runs specfleet commands and flags that exist, and its config parses.

No cluster is needed: this checks the files against the code, so renaming a
flag or a config key breaks this test instead of a deployment.
"""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from specfleet import cli
from specfleet import config as config_mod

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml"))


def _docs(path: pathlib.Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _k8s_objects() -> list[tuple[pathlib.Path, dict]]:
    return [(p, d) for p in MANIFESTS for d in _docs(p) if isinstance(d, dict) and "kind" in d]


def _commands() -> list[tuple[pathlib.Path, list[str]]]:
    """Every `specfleet ...` command line in the manifests: container commands and shell strings."""
    found = []
    for path in MANIFESTS:
        text = path.read_text()
        for doc in _docs(path):
            for node in _walk(doc):
                if isinstance(node, dict) and isinstance(node.get("command"), list) and node["command"][:1] == ["specfleet"]:
                    found.append((path, node["command"] + list(node.get("args", []))))
        # Commands in comments and shell strings (cluster launcher, usage notes).
        for match in re.finditer(r"specfleet ((?:serve|verifier|drafter|router|generate)\b[^'`\n#]*)", text):
            found.append((path, ["specfleet", *match.group(1).split()]))
    return found


def test_there_are_manifests_for_ray_kuberay_and_kubernetes():
    names = {str(p.relative_to(DEPLOY)) for p in MANIFESTS}
    assert {"ray/cluster.yaml", "kuberay/raycluster.yaml"} <= names
    assert any(n.startswith("k8s/") for n in names)
    assert (DEPLOY / "README.md").exists()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_yaml(path):
    docs = _docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict)


def test_kubernetes_objects_are_well_formed():
    objects = _k8s_objects()
    assert objects
    for path, obj in objects:
        where = f"{path.relative_to(DEPLOY)}: {obj.get('kind')}"
        assert obj.get("apiVersion") and obj.get("metadata", {}).get("name"), where
        if obj["kind"] == "Deployment":
            spec = obj["spec"]
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(), where
            for container in spec["template"]["spec"]["containers"]:
                ports = {p["containerPort"] for p in container.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe in container:
                        assert container[probe]["grpc"]["port"] in ports, f"{where}: {probe} on a port the container does not open"
        if obj["kind"] == "Service":
            assert obj["spec"]["selector"] and obj["spec"]["ports"], where


def test_every_deployment_of_k8s_has_probes_and_a_service():
    objects = [(p, o) for p, o in _k8s_objects() if p.parent.name == "k8s"]
    deployments = {o["metadata"]["name"]: o for _, o in objects if o["kind"] == "Deployment"}
    services = [o for _, o in objects if o["kind"] == "Service"]
    assert set(deployments) == {"specfleet-verifier", "specfleet-drafter", "specfleet-router"}
    for name, dep in deployments.items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert "readinessProbe" in container and "livenessProbe" in container, name
        assert "--config" in container["command"] and "/etc/specfleet/config.yaml" in container["command"], name
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert any(s["spec"]["selector"].items() <= labels.items() for s in services), f"no Service selects {name}"


@functools.lru_cache(maxsize=None)
def _help(subcommand: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "specfleet.cli", subcommand, "--help"], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_referenced_commands_and_flags_exist():
    commands = _commands()
    subcommands = {c[1] for _, c in commands}
    assert {"serve", "verifier", "drafter", "router"} <= subcommands
    for path, command in commands:
        assert command[1] in cli.COMMANDS, f"{path}: `specfleet {command[1]}` is not a command"
        flags = {a.split("=")[0] for a in command[2:] if a.startswith("--")}
        usage = _help(command[1])
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", usage), f"{path}: `specfleet {command[1]}` has no flag {flag}"
    assert any(c[1] == "serve" and "--ray" in c for _, c in commands), "no manifest runs `specfleet serve --ray`"


def _embedded_configs() -> list[tuple[pathlib.Path, config_mod.Config]]:
    configs = []
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc.get("kind") == "ConfigMap":
                configs.append((path, config_mod.parse(yaml.safe_load(doc["data"]["config.yaml"]), str(path))))
            elif "verifier" in doc and "kind" not in doc:
                configs.append((path, config_mod.parse(doc, str(path))))
    return configs


def test_embedded_configs_parse():
    configs = _embedded_configs()
    assert {p.parent.name for p, _ in configs} == {"ray", "kuberay", "k8s"}


def _declared_resources() -> dict[str, set[str]]:
    """Custom resources each Ray cluster's nodes declare."""
    declared = {"ray": set(), "kuberay": set()}
    for name, node_type in yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())["available_node_types"].items():
        declared["ray"] |= set(node_type.get("resources", {})) - {"CPU", "GPU", "memory"}
    for path, obj in _k8s_objects():
        if obj["kind"] == "RayCluster":
            for group in obj["spec"]["workerGroupSpecs"]:
                raw = group["rayStartParams"].get("resources")
                if raw:
                    declared["kuberay"] |= set(yaml.safe_load(yaml.safe_load(raw)))
    return declared


def test_ray_configs_ask_for_resources_the_clusters_declare():
    declared = _declared_resources()
    assert declared["ray"] == {"big_gpu", "small_gpu"} and declared["kuberay"] == {"big_gpu", "small_gpu"}
    for path, cfg in _embedded_configs():
        if path.parent.name not in declared:
            continue
        placements = [cfg.verifier.ray] + [d.ray for d in cfg.drafters]
        assert all(p is not None for p in placements), f"{path}: every service needs a ray key"
        assert set(cfg.verifier.ray.resources) == {"big_gpu"}, path
        for p in placements:
            assert set(p.resources) <= declared[path.parent.name], path
