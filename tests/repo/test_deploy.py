"""deploy/ and the Dockerfile: everything about a deployment that can be checked without a cluster.

No cluster, registry or Docker engine is needed: the Dockerfile is linted (hadolint), the
kustomize sources are rendered (`kubectl kustomize`), the rendered Kubernetes objects are
validated against the Kubernetes schemas (`kubernetes-validate --strict`) and the KubeRay ones
against the KubeRay CRD schema (tests/repo/data/kuberay), and the manifests are checked against the
code and the configs they embed: commands and flags that exist, configs that parse, one image,
replicas, resources and devices that agree with the config. Renaming a flag or a config key, or
editing one side of a pair, breaks this test instead of a deployment.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import jsonschema
import pytest
import yaml

from specfleet import cli
from specfleet import config as config_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_SCHEMAS = pathlib.Path(__file__).resolve().parent / "data" / "kuberay"
SOURCES = sorted(DEPLOY.rglob("*.yaml"))
# Every kustomization but a base (which only overlays render) is a deployment of its own.
RENDERED = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml") if p.parent.name != "base")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"specfleet:{VERSION}"  # docker build -t specfleet:VERSION .  (GPU)
IMAGE_CPU = f"specfleet:{VERSION}-cpu"  # docker build --build-arg VARIANT=cpu -t specfleet:VERSION-cpu .
# Where the Dockerfile puts the repository's models/ (WORKDIR /opt/specfleet, COPY models/demo).
IMAGE_MODELS = "/opt/specfleet/models/"
GRPC_SERVICES = {"verifier": "specfleet.v1.Verifier", "drafter": "specfleet.v1.Drafter", "router": "specfleet.v1.Generation"}


def _tool(name: str) -> str:
    """A command of the dev dependencies (pyproject.toml): the one next to this Python first."""
    here = pathlib.Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: `pip install -e '.[dev]'` (scripts/install) installs it")
    return found


def _docs(text: str) -> list:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


@functools.lru_cache(maxsize=None)
def _render(deployment: str) -> tuple:
    out = subprocess.run([_tool("kubectl"), "kustomize", str(DEPLOY / deployment)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize deploy/{deployment}: {out.stderr}"
    return tuple(_docs(out.stdout))


def _objects(deployment: str) -> list[dict]:
    return copy.deepcopy(list(_render(deployment)))


def _named(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _config_of(objects: list[dict], configmap: str) -> config_mod.Config:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(configmap)]
    return config_mod.parse(yaml.safe_load(cm["data"]["config.yaml"]), f"ConfigMap {cm['metadata']['name']}")


def _pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, pod template spec) of a workload: a Deployment or StatefulSet, or each Ray group of a RayJob."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [(obj["metadata"]["name"], obj["spec"]["template"])]
    if obj["kind"] == "RayJob":
        cluster = obj["spec"]["rayClusterSpec"]
        found = [("head", cluster["headGroupSpec"]["template"])]
        found += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
        if "submitterPodTemplate" in obj["spec"]:
            found.append(("submitter", obj["spec"]["submitterPodTemplate"]))
        return found
    return []


# --- the source files ---------------------------------------------------------------------


def test_there_are_deployments_for_ray_kuberay_and_kubernetes():
    names = {str(p.relative_to(DEPLOY)) for p in SOURCES}
    assert {"ray/cluster.yaml", "ray/specfleet.yaml", "kuberay/kustomization.yaml", "k8s/base/kustomization.yaml"} <= names
    assert RENDERED == ["k8s/overlays/cpu", "k8s/overlays/gpu", "kuberay"]
    assert (DEPLOY / "README.md").exists()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_source_is_valid_yaml(path):
    docs = _docs(path.read_text())
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict)


def _commands() -> list[tuple[str, list[str]]]:
    """Every `specfleet ...` command line: container commands of the rendered objects, and shell
    strings and comments of the sources (a RayJob's entry point, the cluster launcher, usage notes)."""
    found = []
    for deployment in RENDERED:
        for node in _walk(_objects(deployment)):
            if isinstance(node, dict) and isinstance(node.get("command"), list) and node["command"][:1] == ["specfleet"]:
                found.append((deployment, node["command"] + list(node.get("args", []))))
    for path in SOURCES + [DEPLOY / "README.md"]:
        for match in re.finditer(r"specfleet ((?:serve|verifier|drafter|router|generate)\b[^'`\n#]*)", path.read_text()):
            found.append((str(path.relative_to(DEPLOY)), ["specfleet", *match.group(1).split()]))
    return found


@functools.lru_cache(maxsize=None)
def _help(subcommand: str) -> str:
    out = subprocess.run([sys.executable, "-m", "specfleet.cli", subcommand, "--help"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_referenced_commands_and_flags_exist():
    commands = _commands()
    subcommands = {c[1] for _, c in commands}
    assert {"serve", "verifier", "drafter", "router"} <= subcommands
    for where, command in commands:
        assert command[1] in cli.COMMANDS, f"{where}: `specfleet {command[1]}` is not a command"
        flags = {a.split("=")[0] for a in command[2:] if a.startswith("--")}
        usage = _help(command[1])
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", usage), f"{where}: `specfleet {command[1]}` has no flag {flag}"
    assert any(c[1] == "serve" and "--ray" in c for _, c in commands), "no manifest runs `specfleet serve --ray`"


def _configs() -> list[tuple[str, config_mod.Config]]:
    """Every specfleet config: the ConfigMaps of the rendered deployments and the cluster launcher's file."""
    configs = []
    for deployment in RENDERED:
        for obj in _objects(deployment):
            if obj["kind"] == "ConfigMap" and "config.yaml" in obj.get("data", {}):
                configs.append((deployment, config_mod.parse(yaml.safe_load(obj["data"]["config.yaml"]), deployment)))
    path = DEPLOY / "ray" / "specfleet.yaml"
    configs.append(("ray", config_mod.parse(yaml.safe_load(path.read_text()), str(path))))
    return configs


def test_every_deployment_has_a_config_that_parses():
    assert sorted(where for where, _ in _configs()) == sorted(RENDERED + ["ray"])


def test_configs_use_models_the_image_holds():
    """A path under the image's model directory must be a model directory of models/ here."""
    for where, cfg in _configs():
        paths = [cfg.verifier.model] + [m.path for svc in cfg.drafters for m in svc.models]
        paths += [m.exemplars_file for svc in cfg.drafters for m in svc.models if m.exemplars_file]
        for path in paths:
            assert path.startswith(IMAGE_MODELS), f"{where}: {path} is not in the image (nor mounted by the manifests)"
            local = ROOT / "models" / path.removeprefix(IMAGE_MODELS)
            assert local.exists() and (local.is_file() or (local / "config.json").exists()), f"{where}: {path}: no {local}"


# --- the image ------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    out = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_is_one_non_root_image_with_specfleet_as_entry_point():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["specfleet"]' in dockerfile
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), f"the last USER must be a numeric non-root uid: {users}"
    assert re.search(r"^WORKDIR /opt/specfleet$", dockerfile, re.M) and "COPY models/demo ./models/demo" in dockerfile
    # Every COPY source is let through by .dockerignore (which starts from excluding everything).
    allowed = {ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")}
    for sources in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for src in sources.split():
            assert src in allowed, f".dockerignore leaves {src} out of the build context"
            assert (ROOT / src).exists(), src
    # The README's build commands make the tags the manifests use.
    readme = (DEPLOY / "README.md").read_text()
    assert f"docker build -t {IMAGE} ." in readme and f"docker build --build-arg VARIANT=cpu -t {IMAGE_CPU} ." in readme


def _build_context(dest: pathlib.Path) -> pathlib.Path:
    """What `docker build .` sends: .dockerignore excludes everything (`*`) but its `!` entries."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore must start by excluding everything"
    excluded = [ln.removeprefix("**/") for ln in lines[1:] if not ln.startswith("!")]
    for entry in (ln[1:].rstrip("/") for ln in lines if ln.startswith("!")):
        src, target = ROOT / entry, dest / entry
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns(*excluded))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def test_the_build_context_builds_specfleet_and_holds_the_demo_models(tmp_path):
    """The Dockerfile's install from the build context: the package builds from it, and specfleet
    run from it (as the image's editable install does) finds the demo models next to its source."""
    context = _build_context(tmp_path / "context")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("specfleet-*.whl")
    probe = "from specfleet import cli, config; c = config.default_config(config.REPO / '.cache'); print(c.verifier.model)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(context)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(context / "models" / "demo" / "target"), out.stdout
    packages = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {"specfleet", "router", "verifier_service", "drafter_service"} <= packages, packages
    assert "specfleet/v1/verifier_pb2.py" in zipfile.ZipFile(wheel).namelist()


def _images(node) -> set[str]:
    return {n["image"] for n in _walk(node) if isinstance(n, dict) and isinstance(n.get("image"), str)}


def test_every_manifest_runs_the_one_image():
    expected = {"k8s/overlays/cpu": IMAGE_CPU, "k8s/overlays/gpu": IMAGE, "kuberay": IMAGE}
    for deployment in RENDERED:
        assert _images(_objects(deployment)) == {expected[deployment]}, deployment
    launcher = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    assert launcher["docker"]["image"] == IMAGE and _images(launcher) == {IMAGE}
    assert not any("pip install" in c for c in launcher.get("setup_commands", [])), "the image holds specfleet already"


# --- schemas -------------------------------------------------------------------------------


def test_kubernetes_objects_pass_kubernetes_validate_strict(tmp_path):
    checked = 0
    for deployment in RENDERED:
        core = [o for o in _objects(deployment) if not o["apiVersion"].startswith("ray.io/")]
        assert core, deployment
        path = tmp_path / f"{deployment.replace('/', '-')}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        out = subprocess.run([_tool("kubernetes-validate"), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"deploy/{deployment}:\n{out.stdout}{out.stderr}"
        checked += len(core)
    assert checked >= 20


def _strict(schema):
    """The CRD schema as the API server applies it to `kubectl apply --validate=strict`: unknown
    fields are errors (where the schema does not keep unknown fields), and a required field
    with a default is filled in before it is checked."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: _strict(v) for k, v in schema.items()}
    props = schema.get("properties")
    if isinstance(props, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
        if "required" in schema:
            schema["required"] = [r for r in schema["required"] if "default" not in props.get(r, {})]
    return schema


@functools.lru_cache(maxsize=None)
def _crd_validator(kind: str):
    path = CRD_SCHEMAS / f"{kind.lower()}.v1.json"
    assert path.exists(), f"no KubeRay schema for {kind}: add {path.name} (tests/repo/data/kuberay/README.md)"
    return jsonschema.Draft7Validator(_strict(json.loads(path.read_text())))


def _crd_errors(obj: dict) -> list[str]:
    validator = _crd_validator(obj["kind"])
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(obj)]


def test_kuberay_objects_match_the_kuberay_crd_schema():
    ray_objects = [o for d in RENDERED for o in _objects(d) if o["apiVersion"].startswith("ray.io/")]
    assert {o["kind"] for o in ray_objects} == {"RayJob"}
    for obj in ray_objects:
        assert obj["apiVersion"] == "ray.io/v1"
        errors = _crd_errors(obj)
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}:\n" + "\n".join(errors)


def test_the_crd_check_refuses_unknown_and_missing_fields():
    (job,) = [o for o in _objects("kuberay") if o["kind"] == "RayJob"]
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")  # a typo
    del group["groupName"]
    errors = "\n".join(_crd_errors(job))
    assert "'replica' was unexpected" in errors and "'groupName' is a required property" in errors


# --- Kubernetes (no Ray) ----------------------------------------------------------------------


def _component(labels: dict) -> str:
    return labels.get("app.kubernetes.io/component", "")


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


@pytest.mark.parametrize("deployment", ["k8s/overlays/cpu", "k8s/overlays/gpu"])
def test_k8s_workloads_have_grpc_probes_services_and_run_as_non_root(deployment):
    objects = _objects(deployment)
    services = _named(objects, "Service")
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert {_component(w["spec"]["template"]["metadata"]["labels"]) for w in workloads} == set(GRPC_SERVICES)
    for workload in workloads:
        name, spec = workload["metadata"]["name"], workload["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert _selects(spec["selector"]["matchLabels"], labels), name
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # readiness: grpc.health.v1 says the service itself is SERVING; liveness: the server answers.
        readiness, liveness = container["readinessProbe"]["grpc"], container["livenessProbe"]["grpc"]
        assert readiness == {"port": ports["grpc"], "service": GRPC_SERVICES[_component(labels)]}, name
        assert liveness["port"] == ports["grpc"] and "startupProbe" in container, name
        assert "--config" in container["command"] and "/etc/specfleet/config.yaml" in container["command"], name
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
        assert mounts["config"] == "/etc/specfleet" and volume["configMap"]["name"].startswith("specfleet-config-")
        front = [s for s in services.values() if _selects(s["spec"]["selector"], labels)]
        assert front, f"no Service selects {name}"
        if workload["kind"] == "StatefulSet":  # pods addressed one by one: a headless Service
            service = services[spec["serviceName"]]
            assert service["spec"]["clusterIP"] == "None" and _selects(service["spec"]["selector"], labels), name


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _verifier_addresses(cfg: config_mod.Config) -> list[str]:
    return cfg.verifier.addresses()


def _stateful_pod(objects: list[dict], address: str, where: str) -> tuple[dict, dict]:
    """The StatefulSet whose pod <name>-<i>.<service> the address names, and that pod's container."""
    host, port = _host_port(address)
    match = re.fullmatch(r"(?P<set>[a-z0-9-]+)-(?P<index>\d+)\.(?P<service>[a-z0-9-]+)", host)
    assert match, f"{where}: {address} is not a StatefulSet pod's address <name>-<i>.<headless Service>:<port>"
    sets = _named(objects, "StatefulSet")
    assert match["set"] in sets, f"{where}: {address}: no StatefulSet {match['set']}"
    sts = sets[match["set"]]
    assert sts["spec"]["serviceName"] == match["service"], f"{where}: {address}: the pods' Service is {sts['spec']['serviceName']}"
    assert int(match["index"]) < sts["spec"]["replicas"], f"{where}: {address}: {match['set']} has {sts['spec']['replicas']} replica(s)"
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert port in {p["containerPort"] for p in container["ports"] if p["name"] == "grpc"}, f"{where}: {address}: port"
    return sts, container


def _quantity(value) -> float:
    value = str(value)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def _check_resources(container: dict, device: str, threads: int, where: str) -> None:
    requests, limits = container["resources"]["requests"], container["resources"].get("limits", {})
    gpus = int(limits.get("nvidia.com/gpu", 0))
    if device.startswith("cuda"):
        assert gpus == 1 and int(requests.get("nvidia.com/gpu", gpus)) == 1, f"{where}: device {device} needs one GPU"
    else:
        assert gpus == 0 and "nvidia.com/gpu" not in requests, f"{where}: device {device} gets no GPU"
    assert _quantity(requests["cpu"]) >= threads, f"{where}: {threads} threads on {requests['cpu']} cpu"


@pytest.mark.parametrize("deployment", ["k8s/overlays/cpu", "k8s/overlays/gpu"])
def test_k8s_replicas_addresses_and_resources_match_the_config(deployment):
    objects = _objects(deployment)
    cfg = _config_of(objects, "specfleet-config")
    addresses = _verifier_addresses(cfg)
    pods = [_stateful_pod(objects, a, f"{deployment}: verifier") for a in addresses]
    (sts,) = {id(s): s for s, _ in pods}.values()
    assert sts["spec"]["replicas"] == len(addresses), f"{deployment}: {sts['spec']['replicas']} verifier pods, {len(addresses)} in the config"
    assert _component(sts["spec"]["template"]["metadata"]["labels"]) == "verifier"
    _check_resources(pods[0][1], cfg.verifier.device, cfg.verifier.threads, f"{deployment}: verifier")
    for svc in cfg.drafters:
        sts, container = _stateful_pod(objects, svc.address, f"{deployment}: drafters[{svc.name}]")
        assert sts["spec"]["replicas"] == 1, f"{deployment}: drafter service {svc.name} is one pod"
        assert container["command"][container["command"].index("--name") + 1] == svc.name
        _check_resources(container, svc.device, svc.threads, f"{deployment}: drafters[{svc.name}]")
    routers = [d for d in _named(objects, "Deployment").values() if _component(d["spec"]["template"]["metadata"]["labels"]) == "router"]
    (router,) = routers
    (container,) = router["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http"], ports["metrics"]) == (cfg.router.port, cfg.router.http_port, cfg.router.metrics_port)
    assert cfg.router.host == "0.0.0.0"


@pytest.mark.parametrize("deployment", ["k8s/overlays/cpu", "k8s/overlays/gpu"])
def test_k8s_verifiers_have_a_disruption_budget_and_only_routers_reach_verifiers_and_drafters(deployment):
    objects = _objects(deployment)
    workloads = {_component(o["spec"]["template"]["metadata"]["labels"]): o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in workloads.items()}
    budgets = [p for p in _named(objects, "PodDisruptionBudget").values() if _selects(p["spec"]["selector"]["matchLabels"], labels["verifier"])]
    assert len(budgets) == 1 and budgets[0]["spec"].get("maxUnavailable") == 1, f"{deployment}: one PodDisruptionBudget for the verifiers"
    policies = list(_named(objects, "NetworkPolicy").values())
    for component in ("verifier", "drafter"):
        (container,) = workloads[component]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        mine = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], labels[component])]
        assert mine, f"{deployment}: no NetworkPolicy isolates the {component} pods"
        for policy in mine:
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            for rule in policy["spec"]["ingress"]:
                rule_ports = {p["port"] for p in rule["ports"]}
                sources = rule["from"]
                if ports["grpc"] in rule_ports:  # the service itself: from router pods of this namespace only
                    where = f"{deployment}: NetworkPolicy {policy['metadata']['name']}: the gRPC port"
                    assert rule_ports == {ports["grpc"]}, f"{where} shares a rule with {rule_ports}"
                    for source in sources:
                        assert set(source) == {"podSelector"}, f"{where} is open to {source} (routers of this namespace only)"
                        selector = source["podSelector"]["matchLabels"]
                        assert _component(selector) == "router" and _selects(selector, labels["router"]), f"{where} is open to {selector}"
                else:  # anything else: only the metrics port
                    assert rule_ports == {ports["metrics"]}, f"{deployment}: NetworkPolicy {policy['metadata']['name']} opens {rule_ports}"


# --- KubeRay ----------------------------------------------------------------------------------


def _declared(group: dict) -> dict[str, float]:
    """Custom resources a Ray worker group's nodes declare (rayStartParams.resources: a quoted JSON map)."""
    raw = group.get("rayStartParams", {}).get("resources")
    return {k: float(v) for k, v in json.loads(json.loads(raw)).items()} if raw else {}


def test_kuberay_worker_groups_match_the_config():
    objects = _objects("kuberay")
    cfg = _config_of(objects, "specfleet-ray-config")
    (job,) = _named(objects, "RayJob").values()
    cluster = job["spec"]["rayClusterSpec"]
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    actors = [("verifier", cfg.verifier.ray, cfg.verifier.device)] + [(f"drafters[{s.name}]", s.ray, s.device) for s in cfg.drafters]
    groups = cluster["workerGroupSpecs"]
    hosted = {g["groupName"]: [] for g in groups}
    for name, placement, device in actors:
        assert placement is not None and placement.resources, f"{name}: needs a ray key with a custom resource naming its group"
        mine = [g for g in groups if set(placement.resources) <= set(_declared(g))]
        assert len(mine) == 1, f"{name}: {len(mine)} worker groups declare {sorted(placement.resources)}"
        group = mine[0]
        hosted[group["groupName"]].append(name)
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        # Ray counts a pod's CPUs and GPUs from these limits: the actor must fit in one pod.
        assert _quantity(limits["cpu"]) >= placement.num_cpus, f"{name}: {placement.num_cpus} CPUs in a {limits['cpu']}-CPU pod"
        assert int(limits.get("nvidia.com/gpu", 0)) == math.ceil(placement.num_gpus), f"{name}: num_gpus {placement.num_gpus}"
        assert device.startswith("cuda") == (placement.num_gpus > 0), f"{name}: device {device} with num_gpus {placement.num_gpus}"
        if device.startswith("cuda"):
            assert placement.num_gpus == 1, f"{name}: a cuda device is the actor's whole GPU"
    for group in groups:
        per_pod = _declared(group)
        wanted = {k: sum(p.resources.get(k, 0) for n, p, _ in actors if n in hosted[group["groupName"]]) for k in per_pod}
        replicas = max(math.ceil(wanted[k] / per_pod[k]) for k in per_pod)
        assert group["replicas"] == replicas, f"worker group {group['groupName']}: {group['replicas']} replicas for {hosted[group['groupName']]}"
        if not autoscaling:
            assert "minReplicas" not in group and "maxReplicas" not in group, f"{group['groupName']}: min/max without the autoscaler"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "actors go to the worker groups, not the head"


def test_kuberay_entry_point_runs_on_the_head_and_serves_the_router():
    objects = _objects("kuberay")
    cfg = _config_of(objects, "specfleet-ray-config")
    (job,) = _named(objects, "RayJob").values()
    entry = job["spec"]["entrypoint"].split()
    # A RayJob's entry point runs on the head node: a Ray driver on a Ray node, which joins with `auto`.
    assert entry[:4] == ["specfleet", "serve", "--ray", "auto"]
    config_path = entry[entry.index("--config") + 1]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    (container,) = head["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    assert config_path == f"{mounts['config']}/config.yaml"
    assert volumes["config"]["configMap"]["name"] in _named(objects, "ConfigMap")
    # The router listens in the head pod, and the Service `specfleet` selects that pod.
    assert cfg.router.host == "0.0.0.0"
    assert {cfg.router.port, cfg.router.http_port} <= {p["containerPort"] for p in container["ports"]}
    service = _named(objects, "Service")["specfleet"]
    assert _selects(service["spec"]["selector"], head["metadata"]["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {cfg.router.port, cfg.router.http_port}
    # Token authentication: every Ray container and the submitter get the token.
    for where, template in _pod_templates(job):
        for c in template["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["RAY_AUTH_MODE"]["value"] == "token", where
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "specfleet-ray-token", where


# --- Ray cluster launcher ---------------------------------------------------------------------


def test_ray_launcher_config_asks_for_resources_the_node_types_declare():
    launcher = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    declared = set()
    for node_type in launcher["available_node_types"].values():
        declared |= set(node_type.get("resources", {})) - {"CPU", "GPU", "memory"}
    assert declared == {"big_gpu", "small_gpu"}
    (cfg,) = [c for where, c in _configs() if where == "ray"]
    services = [("verifier", cfg.verifier.ray, cfg.verifier.device)] + [(s.name, s.ray, s.device) for s in cfg.drafters]
    for name, placement, device in services:
        assert placement is not None and set(placement.resources) <= declared, name
        assert device.startswith("cuda") == (placement.num_gpus > 0), f"{name}: device {device} with num_gpus {placement.num_gpus}"
    assert set(cfg.verifier.ray.resources) == {"big_gpu"}
    # One node per actor: each worker type starts as many nodes as actors ask for its resource.
    for type_name, node_type in launcher["available_node_types"].items():
        custom = set(node_type.get("resources", {})) - {"CPU", "GPU", "memory"}
        actors = sum(1 for _, p, _ in services if set(p.resources) & custom)
        assert node_type.get("min_workers", 0) == node_type.get("max_workers", 0) == actors, f"{type_name}: {actors} actor(s)"
    assert launcher["max_workers"] == len(services)


def test_the_k8s_steps_create_every_secret_the_pods_mount_before_applying():
    """A pod that mounts a Secret which does not exist waits forever: deploy/README.md's k8s steps create each one the
    manifests mount (not marked optional) before the first `kubectl apply -k deploy/k8s/...`."""
    mounted = set()
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            text = json.dumps(doc)
            mounted |= set(re.findall(r'"secretName": "([^"]+)"', text))
    assert "specfleet-internal-token" in mounted
    readme = (DEPLOY / "README.md").read_text()
    applied = readme.index("kubectl apply -k deploy/k8s")
    created = set(re.findall(r"kubectl create secret generic (\S+)", readme[:applied]))
    assert mounted <= created, f"created after `kubectl apply`, or never: {sorted(mounted - created)}"
