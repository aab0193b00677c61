"""Every service's /metrics, scraped by a real Prometheus server and read back through its query API."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from specfleet.v1 import generation_pb2_grpc
from tests.harness import REPO, Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (scripts/ensure-prometheus)")


@pytest.fixture(scope="module")
def metered(random_family, tmp_path_factory):
    config = cluster_config(
        random_family,
        router={"metrics_port": free_port(), "http_port": 0},
        verifier={"metrics_port": free_port()},
        drafter_service={"metrics_port": free_port()},
    )
    cluster = Cluster(config, tmp_path_factory.mktemp("metered"), "metered").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def prometheus(metered, tmp_path_factory):
    """Prometheus on 127.0.0.1 and a free port, its storage in tmp, scraping the three services every second."""
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = {
        "router": metered.config["router"]["metrics_port"],
        "verifier": metered.config["verifier"]["metrics_port"],
        "drafter": metered.config["drafters"][0]["metrics_port"],
    }
    (workdir / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]} for job, port in targets.items()],
            }
        )
    )
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(url + "/-/ready", timeout=5).status == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"prometheus did not start; log:\n{(workdir / 'prometheus.log').read_text()[-3000:]}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def query(url: str, expr: str) -> dict[str, float]:
    """An instant query: {job label: value}."""
    reply = json.loads(urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10).read())
    assert reply["status"] == "success", reply
    return {r["metric"].get("job", ""): float(r["value"][1]) for r in reply["data"]["result"]}


def wait_for(url: str, expr: str, want, timeout_s: float = 120.0) -> dict[str, float]:
    """Poll until `want(result)` holds (Prometheus sees a change one scrape later); the last result either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(url, expr)
        if want(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_prometheus_scrapes_every_service_and_reads_back_tokens_and_latency(metered, prometheus):
    up = wait_for(prometheus, "up", lambda r: len(r) == 3 and all(v == 1 for v in r.values()))
    assert up == {"router": 1, "verifier": 1, "drafter": 1}
    generated = 0
    with metered.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for prompt in PROMPTS[:4]:
            generated += len(stub.Generate(greedy_request(prompt, 16, 4), timeout=120).token_ids)

    tokens = wait_for(prometheus, "specfleet:generation_tokens_total", lambda r: r.get("router") == generated)
    assert tokens == {"router": generated}
    # Every router series carries the served model's name, as vLLM's do (dashboards written for vLLM filter on it).
    model_name = pathlib.Path(metered.config["verifier"]["model"]).name
    assert query(prometheus, f'specfleet:generation_tokens_total{{model_name="{model_name}"}}') == {"router": generated}
    assert query(prometheus, '{job="router", model_name="", __name__=~"specfleet:.*"}') == {}
    ttft = wait_for(prometheus, "specfleet:time_to_first_token_seconds_count", lambda r: r.get("router") == 4)
    assert ttft == {"router": 4}
    # A latency histogram answers a quantile query: the median end-to-end latency is a time.
    e2e = query(prometheus, "histogram_quantile(0.5, sum by (le) (specfleet:e2e_request_latency_seconds_bucket))")
    assert 0 < e2e[""] < 120
    assert query(prometheus, 'specfleet:request_success_total{finished_reason=~"length|eos"}')
    # Drafting happened and the verifier and the drafter timed their passes.
    assert wait_for(prometheus, "specfleet:spec_decode_num_draft_tokens_total", lambda r: r.get("router", 0) > 0)["router"] > 0
    assert wait_for(prometheus, "specfleet:verifier_pass_seconds_count", lambda r: r.get("verifier", 0) > 0)["verifier"] > 0
    drafter = wait_for(prometheus, 'specfleet:drafter_batch_size_count{drafter_service="drafters"}', lambda r: r.get("drafter", 0) > 0)
    assert drafter["drafter"] > 0
    # Finished requests leave no session behind on the verifier.
    assert wait_for(prometheus, "specfleet:sessions", lambda r: r.get("verifier") == 0)["verifier"] == 0


def test_every_query_of_the_grafana_dashboard_reads_exported_metrics(metered, prometheus):
    """deploy/grafana's dashboard names only metrics the services export, and Prometheus accepts every query."""
    dashboard = json.loads((REPO / "deploy" / "grafana" / "specfleet-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exported = set()
    for port in (metered.config["router"]["metrics_port"], metered.config["verifier"]["metrics_port"], metered.config["drafters"][0]["metrics_port"]):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        # Families by their # TYPE lines: a labelled counter has no sample before its first event.
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
            suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(kind, ("",))
            exported |= {name.removesuffix("_total") + suffix for suffix in suffixes}
    named = {name for expr in exprs for name in re.findall(r"specfleet:[a-z0-9_]+", expr)}
    assert len(named) > 20 and named <= exported, sorted(named - exported)
    for expr in exprs:
        grafana_free = expr.replace("$__rate_interval", "1m")
        reply = json.loads(urllib.request.urlopen(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': grafana_free})}", timeout=10).read())
        assert reply["status"] == "success", (expr, reply)
