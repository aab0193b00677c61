"""specfleet on Ray: a real two-node Ray cluster on loopback, actors placed by custom resources.

The head node declares `big_gpu`, the worker node `small_gpu`; the config asks
the verifier for big_gpu and the drafter for small_gpu. `specfleet serve --ray
ADDRESS` creates the actors and runs the router over Ray transports. The tests
check where each actor landed, that greedy output equals the target's own
`generate`, and that killing the drafter actor costs nothing but speed.

A second `specfleet serve --ray ray://127.0.0.1:PORT`, in a namespace of its own on
the same cluster, is a driver outside the cluster (Ray Client, through the head's
client server) with two verifier actors: it serves the same output, and killing
one verifier actor mid-stream loses no request.

Token authentication stays on: the cluster and every process joining it get a
fresh token through RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (nothing is written
to ~/.ray). The cluster's processes are this test's own: `ray start --block`
children, stopped by signalling their process groups (`ray stop` would stop
every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from router import breaker
from specfleet import config as config_mod
from tests.harness import DRAFTING_PAYS, REPO, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy

pytestmark = pytest.mark.timeout(420)

RAY_BIN = pathlib.Path(sys.executable).parent / "ray"
NAMESPACE = "specfleet-test"


# --- config: the placement keys, no cluster needed -------------------------------------------------------------


def _base(**verifier_ray):
    return {
        "verifier": {"model": "m", "ray": verifier_ray},
        "drafters": [{"name": "d", "models": [{"name": "x", "path": "p"}], "ray": {"resources": {"small_gpu": 0.5}}}],
    }


def test_placement_config_parses_and_round_trips():
    cfg = config_mod.parse(_base(num_cpus=2, num_gpus=1, resources={"big_gpu": 1}, label_selector={"gpu": "h100"}, max_restarts=-1))
    assert cfg.verifier.ray.resources == {"big_gpu": 1.0} and cfg.verifier.ray.num_gpus == 1.0
    assert cfg.verifier.ray.label_selector == {"gpu": "h100"} and cfg.verifier.ray.max_restarts == -1
    assert cfg.drafters[0].ray.resources == {"small_gpu": 0.5}
    assert config_mod.parse(yaml.safe_load(cfg.to_yaml())) == cfg
    no_ray = config_mod.parse({"verifier": {"model": "m"}})
    assert no_ray.verifier.ray is None and config_mod.parse(yaml.safe_load(no_ray.to_yaml())) == no_ray


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_gpus": -1}, "verifier.ray.num_gpus"),
        ({"num_gpus": 1.5}, "verifier.ray.num_gpus"),
        ({"resources": {"big_gpu": "one"}}, "verifier.ray.resources"),
        ({"resources": {"GPU": 1}}, "verifier.ray.resources.GPU"),
        ({"resources": {"big_gpu": 0}}, "verifier.ray.resources.big_gpu"),
        ({"label_selector": {"gpu": 1}}, "verifier.ray.label_selector"),
        ({"max_restarts": -2}, "verifier.ray.max_restarts"),
        ({"num_cpu": 1}, "unknown key"),
    ],
)
def test_placement_config_refuses_bad_values(bad, message):
    with pytest.raises(config_mod.ConfigError, match=message.replace(".", r"\.")):
        config_mod.parse(_base(**bad))


def test_actor_options_follow_the_config():
    from specfleet import ray_actors

    cfg = config_mod.parse(_base(num_cpus=0, resources={"big_gpu": 1}, label_selector={"gpu": "h100"}, max_restarts=2, memory_mb=64))
    opts = ray_actors.actor_options(cfg.verifier.ray, "verifier", "ns", detached=True)
    assert opts["resources"] == {"big_gpu": 1.0} and opts["label_selector"] == {"gpu": "h100"}
    assert opts["max_restarts"] == 2 and opts["num_cpus"] == 0 and opts["memory"] == 64 * 2**20
    assert opts["lifetime"] == "detached" and opts["name"] == "verifier" and opts["namespace"] == "ns"
    assert "lifetime" not in ray_actors.actor_options(None, "x", "ns", detached=False)


def test_one_verifier_actor_per_replica():
    """Under Ray the verifier's addresses only count its actors; each has the verifier's placement, and a local
    one-node Ray declares the custom resources of all of them."""
    from specfleet import ray_actors, ray_cluster

    config = _base(resources={"big_gpu": 0.5})
    config["verifier"]["replicas"] = ["127.0.0.1:50063", "127.0.0.1:50064"]
    cfg = config_mod.parse(config)
    assert ray_actors.verifier_actor_names(cfg) == ["verifier", "verifier-1", "verifier-2"]
    placements = ray_actors.actor_placements(cfg)
    assert list(placements) == ["verifier", "verifier-1", "verifier-2", "drafter-d"]
    assert all(placements[n].resources == {"big_gpu": 0.5} for n in ("verifier", "verifier-1", "verifier-2"))
    assert ray_cluster._local_resources(cfg) == {"big_gpu": 1.5, "small_gpu": 0.5}
    assert ray_actors.verifier_actor_names(config_mod.parse(_base())) == ["verifier"]


def test_a_split_verifier_asks_for_a_bundle_per_rank():
    """tensor_parallel_size 2 under Ray: a placement group bundle per rank, each what `verifier.ray` asks for; a local
    cluster declares both ranks' resources and CPUs; a bundle of nothing is refused naming what to set."""
    from specfleet import ray_actors, ray_cluster

    config = _base(num_cpus=1, resources={"big_gpu": 0.5})
    config["verifier"]["tensor_parallel_size"] = 2
    cfg = config_mod.parse(config)
    assert ray_actors.rank_bundles(cfg.verifier.ray, 2) == [{"CPU": 1.0, "big_gpu": 0.5}] * 2
    assert ray_cluster._local_resources(cfg) == {"big_gpu": 1.0, "small_gpu": 0.5}
    assert ray_cluster._local_cpus(cfg) == max(os.cpu_count(), 3)  # two ranks and the drafter, one CPU each
    with pytest.raises(ValueError, match="set num_cpus, num_gpus or resources above 0"):
        ray_actors.rank_bundles(config_mod.RayPlacement(num_cpus=0), 2)


def test_grpc_services_still_refuse_bad_requests_as_invalid_argument(cluster):
    """The servicers now delegate to VerifierCore/DrafterCore (shared with the actors); refusals stay INVALID_ARGUMENT."""
    import grpc

    from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    with cluster.channel(cluster.verifier) as channel:
        bad = verifier_pb2.VerifyRequest(sessions=[verifier_pb2.VerifySession(sync=common_pb2.SessionSync(session_id=""))])
        with pytest.raises(grpc.RpcError) as err:
            verifier_pb2_grpc.VerifierStub(channel).Verify(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.value.details()
    with cluster.channel(cluster.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        bad = drafter_pb2.DraftRequest(
            sessions=[drafter_pb2.DraftSession(sync=common_pb2.SessionSync(session_id="s", new_token_ids=[1]), model="nope")]
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown draft model" in err.value.details()
        assert len(stub.GetInfo(common_pb2.InfoRequest(), timeout=30).models) == 1


# --- a real cluster ---------------------------------------------------------------------------------------------------


class RayNodes:
    """Two `ray start --block` nodes on loopback: head with big_gpu and the Ray Client server, worker with small_gpu."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        # Ray puts unix sockets under its temp dir: keep the path short.
        self.temp = tempfile.mkdtemp(prefix="sfray-", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.client_address = f"ray://127.0.0.1:{free_port()}"
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # The actors import this tree's code, as nodes of a real cluster import the image's (a Ray Client
            # driver sends no code; the editable install would give them another checkout's).
            "PYTHONPATH": str(REPO),
        }
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.workdir / f"ray-{name}.log", "w")
        common = ["--block", "--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
        self.procs.append(
            subprocess.Popen([str(RAY_BIN), "start", *args, *common], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def start(self, timeout_s: float = 150.0) -> "RayNodes":
        client_port = self.client_address.rsplit(":", 1)[1]
        self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--ray-client-server-port={client_port}",
                f"--temp-dir={self.temp}",
                "--include-dashboard=false",
                '--resources={"big_gpu": 2}',
            ],
        )
        self._wait_nodes(1, timeout_s)
        self._start("worker", [f"--address={self.address}", '--resources={"small_gpu": 2}'])
        self.nodes = self._wait_nodes(2, timeout_s)
        return self

    def _wait_nodes(self, count: int, timeout_s: float) -> list[dict]:
        """Poll from a short-lived driver until `count` nodes are alive; returns them."""
        probe = (
            "import json, ray, sys, time\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while True:\n"
            "    nodes = [n for n in ray.nodes() if n['Alive']]\n"
            f"    if len(nodes) >= {count} or time.monotonic() > deadline:\n"
            "        print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} for n in nodes])); break\n"
            "    time.sleep(0.5)\n"
        )
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start exited with {p.returncode}; see {self.workdir}")
            out = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, timeout=timeout_s + 30)
            if out.returncode == 0:
                nodes = json.loads(out.stdout.strip().splitlines()[-1])
                if len(nodes) >= count:
                    return nodes
            last = out.stderr[-2000:]
            time.sleep(1)
        raise RuntimeError(f"Ray cluster with {count} node(s) did not come up in {timeout_s:.0f}s: {last}")

    def stop(self) -> None:
        # Worker first, then head. SIGTERM to `ray start --block` alone: it drains its node and stops the node's
        # processes in order (signalling the whole group at once kills the GCS first and the drain waits 30 s).
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            try:  # anything of this node left in its own process group
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


class RayServe:
    """`specfleet serve --ray ADDRESS --config FILE`, as a user would run it (ADDRESS: the GCS address by default)."""

    def __init__(
        self, nodes: RayNodes, config: dict, workdir: pathlib.Path, address: str | None = None, namespace: str = NAMESPACE, name: str = "serve"
    ):
        self.config_path = workdir / f"{name}-config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.router = f"127.0.0.1:{config['router']['port']}"
        self.nodes = nodes
        self.address = address or nodes.address
        self.namespace = namespace
        self.stdout_lines: list[str] = []

    def start(self, timeout_s: float = 240.0) -> "RayServe":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specfleet.cli", "serve", "--ray", self.address, "--namespace", self.namespace, "--config", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
            env=self.nodes.env,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.stdout_lines.append(line)
            if "specfleet is ready" in line:
                return self
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        client_servers = "".join(
            f"\n{path.name}:\n{path.read_text()[-3000:]}"
            for path in sorted(pathlib.Path(self.nodes.temp).glob("session_latest/logs/ray_client_server*"))
        )
        raise RuntimeError(
            f"specfleet serve --ray did not start; stdout:\n{''.join(self.stdout_lines)}\nlog:\n{self.log_path.read_text()[-6000:]}{client_servers}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory):
    if not RAY_BIN.exists():
        pytest.skip(f"no ray executable next to {sys.executable}")
    nodes = RayNodes(tmp_path_factory.mktemp("ray"))
    try:
        nodes.start()
    except BaseException:
        nodes.stop()
        raise
    yield nodes
    nodes.stop()


def serve_config(random_family, verifier_ray: dict, drafter_ray: dict, **verifier) -> dict:
    return {
        "verifier": {"model": str(random_family["target"]), "ray": verifier_ray, **verifier},
        "drafters": [{"name": "small", "models": [{"name": "drafter-noisy", "path": str(random_family["drafter-noisy"])}], "ray": drafter_ray}],
        # verifier_wait_s: how long requests wait once no verifier is left (the last test here kills the only one).
        # Drafting as k asks on any machine, as cluster_config's clusters (tests/harness.py `DRAFTING_PAYS`).
        "router": {
            "port": free_port(),
            "default_drafter": "drafter-noisy",
            "startup_timeout_s": 240,
            "verifier_wait_s": 15,
            "remeasure_every": 0,
            **DRAFTING_PAYS,
        },
    }


@pytest.fixture(scope="module")
def ray_serve(random_family, ray_nodes):
    config = serve_config(
        random_family,
        {"num_cpus": 0, "resources": {"big_gpu": 1}, "max_restarts": 0},
        {"num_cpus": 0, "resources": {"small_gpu": 1}, "max_restarts": 2},
    )
    serve = RayServe(ray_nodes, config, ray_nodes.workdir).start()
    yield serve
    serve.stop()


def ray_query(serve: RayServe, body: str, timeout_s: float = 240.0):
    """Run `body` in a separate Ray driver of the test cluster (with its token), in the namespace of `serve`'s
    actors; it sets `result`, returned as JSON.

    A separate process, because a Ray driver reads its authentication settings once, at import.
    """
    script = (
        "import json, ray\n"
        f"ray.init(address={serve.nodes.address!r}, namespace={serve.namespace!r}, logging_level='ERROR', log_to_driver=False)\n"
        + body
        + "\nprint('RESULT ' + json.dumps(result))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=serve.nodes.env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"ray query failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


WHERE_BOTH = "result = {n: ray.get(ray.get_actor(n).where.remote(), timeout=120) for n in ('verifier', 'drafter-small')}"


def _generate(serve: RayServe, prompt: str, max_tokens: int, k: int = 4):
    import grpc

    from specfleet.serving import CHANNEL_OPTIONS
    from specfleet.v1 import generation_pb2_grpc

    with grpc.insecure_channel(serve.router, options=CHANNEL_OPTIONS) as channel:
        return generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt, max_tokens, k=k), timeout=120)


def test_actors_land_on_the_nodes_with_their_resources(ray_serve):
    by_resource = {r: n["id"] for n in ray_serve.nodes.nodes for r in ("big_gpu", "small_gpu") if r in n["resources"]}
    assert set(by_resource) == {"big_gpu", "small_gpu"} and by_resource["big_gpu"] != by_resource["small_gpu"]
    where = ray_query(ray_serve, WHERE_BOTH)
    verifier, drafter = where["verifier"], where["drafter-small"]
    assert verifier["node_id"] == by_resource["big_gpu"] and verifier["resources"].get("big_gpu") == 1.0
    assert drafter["node_id"] == by_resource["small_gpu"] and drafter["resources"].get("small_gpu") == 1.0
    # serve printed the placement: each actor with its node.
    printed = "".join(ray_serve.stdout_lines)
    assert "placement" in printed
    for name, info in [("verifier", verifier), ("drafter-small", drafter)]:
        line = next(ln for ln in printed.splitlines() if ln.strip().startswith(name + " "))
        assert info["node_id"][:12] in line and f"pid {info['pid']}" in line


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "The quick brown fox", "name: specfleet\nversion:"])
def test_greedy_through_ray_equals_target_generate(ray_serve, random_family, prompt):
    reply = _generate(ray_serve, prompt, max_tokens=16)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 16)
    assert reply.speculation.draft_tokens > 0, "the drafter actor was not used"


def test_killed_drafter_actor_costs_only_speed(ray_serve, random_family):
    # max_restarts: 2, so Ray brings the drafter back (on a node with small_gpu: the same one).
    before = ray_query(
        ray_serve,
        "h = ray.get_actor('drafter-small')\nresult = ray.get(h.where.remote(), timeout=120)\nray.kill(h, no_restart=False)",
    )
    prompt = "import os\nimport sys\n"
    reply = _generate(ray_serve, prompt, max_tokens=12)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 12)
    # The request above may finish (decoding plainly) before Ray has restarted the actor: wait for it.
    after = ray_query(
        ray_serve,
        "import time\n"
        "deadline = time.monotonic() + 120\n"
        "while True:\n"
        "    try:\n"
        "        result = ray.get(ray.get_actor('drafter-small').where.remote(), timeout=120)\n"
        "        break\n"
        "    except ray.exceptions.ActorUnavailableError:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(0.5)\n",
    )
    assert after["pid"] != before["pid"] and after["restarted"] and after["node_id"] == before["node_id"]
    # The restarted drafter has lost its sessions (the router resends them) and drafts again through its transport.
    # The router's circuit breaker probes the service after a backoff of at most 8 s (router/breaker.py), so
    # drafting resumes within a few probes of the restart, not necessarily on the next request.
    expected = target_greedy(str(random_family["target"]), prompt, 12)
    deadline = time.monotonic() + 3 * breaker.MAX_BACKOFF_S
    while True:
        reply = _generate(ray_serve, prompt, max_tokens=12)
        assert list(reply.token_ids) == expected
        if reply.speculation.draft_tokens > 0:
            break
        assert time.monotonic() < deadline, "the router did not draft with the restarted drafter actor"
        time.sleep(0.5)
    body = (
        "import asyncio\n"
        "from router import messages, ray_transport\n"
        "from specfleet.sampling import SamplingParams\n"
        "session = messages.DraftSession(sync=messages.SessionSync(session_id='probe', new_token_ids=[1, 2, 3]),"
        " model='drafter-noisy', num_draft_tokens=3, sampling=SamplingParams(top_p=1.0))\n"
        "reply = asyncio.run(ray_transport.RayDrafter('small', ray.get_actor('drafter-small')).draft([session], 60))\n"
        "result = [reply.sessions[0].known, len(reply.sessions[0].token_ids)]\n"
    )
    assert ray_query(ray_serve, body) == [True, 3]


def test_refused_request_maps_to_invalid_argument(ray_serve):
    """A request the actor refuses reaches the scheduler as the gRPC service's INVALID_ARGUMENT would."""
    body = (
        "import asyncio\n"
        "from router import messages, ray_transport\n"
        "from router.transport import TransportError\n"
        "from specfleet.sampling import SamplingParams\n"
        "bad = [messages.VerifySession(sync=messages.SessionSync(session_id=''), tree=messages.TokenTree(), sampling=SamplingParams())]\n"
        "async def go():\n"
        "    try:\n"
        "        await ray_transport.RayVerifier('verifier', ray.get_actor('verifier')).verify(bad, 60)\n"
        "    except TransportError as err:\n"
        "        return [err.code().name, err.invalid_argument, err.details()]\n"
        "result = asyncio.run(go())\n"
    )
    code, invalid, details = ray_query(ray_serve, body)
    assert code == "INVALID_ARGUMENT" and invalid and "session_id is required" in details


def test_dead_verifier_actor_fails_requests_unavailable(ray_serve):
    """Last of `ray_serve`'s: its verifier (max_restarts: 0) is killed for good; requests fail UNAVAILABLE and the router keeps serving."""
    import grpc

    ray_query(ray_serve, "ray.kill(ray.get_actor('verifier'), no_restart=True)\nresult = True")
    with pytest.raises(grpc.RpcError) as err:
        _generate(ray_serve, "The", max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert ray_serve.proc.poll() is None


# --- a driver outside the cluster (Ray Client), two verifier actors ---------------------------------------------------

CLIENT_NAMESPACE = "specfleet-client-test"


@pytest.fixture(scope="module")
def ray_client_serve(random_family, ray_nodes):
    """`specfleet serve --ray ray://...`: a process that is not a Ray node. The verifier lists two replicas (their
    addresses only count them under Ray): two actors, each with its target split over two ranks
    (tensor_parallel_size 2): a placement group per replica of two bundles of half the head's big_gpu, rank 0 the
    verifier's actor, rank 1 an actor it starts in the other bundle; restarted once. The drafter service's model is
    split over two ranks the same way, on the worker node."""
    config = serve_config(
        random_family,
        {"num_cpus": 0, "resources": {"big_gpu": 0.5}, "max_restarts": 1},
        {"num_cpus": 0, "resources": {"small_gpu": 0.5}, "max_restarts": 0},
        address="127.0.0.1:50061",
        replicas=["127.0.0.1:50063"],
        tensor_parallel_size=2,
    )
    config["drafters"][0]["tensor_parallel_size"] = 2
    serve = RayServe(ray_nodes, config, ray_nodes.workdir, address=ray_nodes.client_address, namespace=CLIENT_NAMESPACE, name="client-serve").start()
    yield serve
    serve.stop()


def _children(pid: int) -> list[int]:
    return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


CLIENT_ACTORS = ("verifier", "verifier-1", "drafter-small")


def test_ray_client_driver_with_two_verifier_actors_serves_the_target_greedy(ray_client_serve, random_family):
    serve = ray_client_serve
    # Token authentication is on for the client server too: a client with another token does not get in.
    intruder = subprocess.Popen(
        [sys.executable, "-c", f"import ray; ray.init({serve.address!r}, logging_level='ERROR'); print('CONNECTED')"],
        env={**serve.nodes.env, "RAY_AUTH_TOKEN": secrets.token_hex(32)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    where = ray_query(serve, f"result = {{n: ray.get(ray.get_actor(n).where.remote(), timeout=120) for n in {CLIENT_ACTORS!r}}}")
    head = next(n["id"] for n in serve.nodes.nodes if "big_gpu" in n["resources"])
    for name in ("verifier", "verifier-1"):
        assert where[name]["node_id"] == head and where[name]["resources"].get("big_gpu") == 0.5, where[name]
    assert where["verifier"]["pid"] != where["verifier-1"]["pid"]
    # Each replica's ranks: one placement group on one node, rank 1 an actor of its own in bundle 1.
    groups = ray_query(serve, "result = {k: (v['strategy'], v['bundles']) for k, v in ray.util.placement_group_table().items()}")
    worker = next(n["id"] for n in serve.nodes.nodes if "small_gpu" in n["resources"])
    split = {"verifier": (head, {"big_gpu": 0.5}), "verifier-1": (head, {"big_gpu": 0.5}), "drafter-small": (worker, {"small_gpu": 0.5})}
    for name, (node, resources) in split.items():
        strategy, bundles = groups[where[name]["placement_group"]]
        assert strategy == "STRICT_PACK" and list(bundles.values()) == [resources] * 2, (strategy, bundles)
        [rank] = ray_query(serve, f"result = ray.get(ray.get_actor({name!r}).ranks.remote(), timeout=120)")
        assert rank["node_id"] == node and rank["resources"] == resources, rank
        assert rank["placement_group"] == where[name]["placement_group"] and rank["pid"] not in (where["verifier"]["pid"], where["verifier-1"]["pid"])
    printed = "".join(serve.stdout_lines)
    assert "verifier-1/rank-1 " in printed and "drafter-small/rank-1 " in printed, printed
    assert f"through Ray Client {serve.address}" in printed
    assert all(any(ln.strip().startswith(n + " ") for ln in printed.splitlines()) for n in CLIENT_ACTORS), printed
    # Neither serve nor its router is a driver on a Ray node: the jobs' drivers are the head's client servers.
    ours = {serve.proc.pid, *_children(serve.proc.pid)}
    assert len(ours) == 2, ours
    drivers = ray_query(serve, "result = [(j['DriverPid'], j['Entrypoint']) for j in ray._private.state.jobs() if not j['IsDead']]")
    assert not ours & {pid for pid, _ in drivers}, drivers
    assert sum("ray.util.client.server" in entry for _, entry in drivers) >= 2, drivers
    target = str(random_family["target"])
    for prompt in ("def fibonacci(n):", "name: specfleet\nversion:"):
        reply = _generate(serve, prompt, max_tokens=16)
        assert list(reply.token_ids) == target_greedy(target, prompt, 16)
        assert reply.speculation.draft_tokens > 0, "the drafter actor was not used"
    out, err = intruder.communicate(timeout=120)
    assert intruder.returncode != 0 and "CONNECTED" not in out, (out, err[-2000:])


def test_killed_verifier_rank_loses_no_request(ray_client_serve, random_family):
    """kill -9 rank 1 (an actor) of one of the two verifier actors with 8 streams in flight: the verifier's actor
    exits with it (a replica that lost a rank cannot serve), its requests move to the other actor, which rebuilds
    their KV from the token ids; none fails and every output is the target's own. Ray restarts the actor in its
    placement group, where it starts a new rank 1."""
    from tests.e2e.test_supervision import Streams

    serve = ray_client_serve
    ranks_and_where = "actor = ray.get_actor('verifier-1')\nresult = ray.get([actor.ranks.remote(), actor.where.remote()], timeout=120)"
    [rank], before = ray_query(serve, ranks_and_where)
    streams = Streams([serve.router], [PROMPTS[i] for i in range(8)], max_tokens=160)
    streams.start()
    os.kill(rank["pid"], signal.SIGKILL)
    streams.join()
    streams.check(str(random_family["target"]))
    log = serve.log_path.read_text()
    assert re.search(r"request \S+ moves to verifier replica ray actor verifier\b(?!-)", log), log[-4000:]
    # The router keeps serving on the live actor.
    reply = _generate(serve, PROMPTS[0], max_tokens=8)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), PROMPTS[0], 8)
    assert serve.proc.poll() is None
    # Ray may still be restarting the actor (the streams can end before it has): asked until it answers.
    restarted = (
        "import time\n"
        "deadline = time.monotonic() + 120\n"
        "while True:\n"
        "    try:\n" + "".join("        " + line + "\n" for line in ranks_and_where.splitlines()) + "        break\n"
        "    except ray.exceptions.ActorUnavailableError:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(0.5)"
    )
    [new_rank], after = ray_query(serve, restarted)
    assert after["restarted"] and after["pid"] != before["pid"] and after["placement_group"] == before["placement_group"], (before, after)
    assert new_rank["pid"] != rank["pid"] and new_rank["placement_group"] == before["placement_group"], (rank, new_rank)
