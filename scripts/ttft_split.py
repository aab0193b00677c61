"""Where an HTTP request's extra time to first token goes: the same closed-loop load (4 clients, 32 requests of 32
tokens, speculation off) over gRPC and over the OpenAI-compatible HTTP API of one `specfleet serve` (demo models,
every process on core 0), in turn, three times; for each, the clients' time to first token and the router's own
(specfleet:time_to_first_token_seconds: admission to the first token published, before any transport).

    .venv/bin/python scripts/ttft_split.py
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import requests  # noqa: E402

from specfleet.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from tools.bench.systems import free_port  # noqa: E402

PROMPT, TOKENS, CLIENTS, REQUESTS = list(range(1000, 1064)), 32, 4, 32


def server_ttft(port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("specfleet:time_to_first_token_seconds_")]
    found = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    return found["specfleet:time_to_first_token_seconds_sum"], found["specfleet:time_to_first_token_seconds_count"]


def main() -> None:
    port, http, metrics = free_port(), free_port(), free_port()
    serve = [".venv/bin/specfleet", "serve", "--port", str(port), "--http-port", str(http), "--set", f"router.metrics_port={metrics}"]
    proc = subprocess.Popen(["taskset", "-c", "0", *serve], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:
        if "specfleet is ready" in line:
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def over_grpc(_: int) -> float:
        request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=TOKENS, temperature=0, stop_at_eos=False)
        request.speculation.disabled = True
        started, first = time.perf_counter(), None
        for chunk in stub.GenerateStream(request):  # read to its end, as the HTTP client reads its stream
            if first is None and chunk.token_ids:
                first = time.perf_counter() - started
        return first

    def over_http(_: int) -> float:
        body = {"model": "target", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        body.update(return_token_ids=True, speculation={"disabled": True})
        started, first = time.perf_counter(), None
        with requests.post(f"http://127.0.0.1:{http}/v1/completions", json=body, stream=True, timeout=300) as reply:
            for line in reply.iter_lines():
                if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                    first = time.perf_counter() - started
        return first

    try:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            print("| pass | transport | clients' TTFT p50 / mean ms | router's TTFT mean ms |\n|---|---|---|---|")
            for n in range(3):
                for name, call in (("gRPC", over_grpc), ("HTTP", over_http)):
                    list(pool.map(call, range(CLIENTS)))  # warm
                    before = server_ttft(metrics)
                    firsts = sorted(pool.map(call, range(REQUESTS)))
                    after = server_ttft(metrics)
                    router = (after[0] - before[0]) / (after[1] - before[1])
                    clients = f"{firsts[REQUESTS // 2] * 1e3:.1f} / {sum(firsts) / REQUESTS * 1e3:.1f}"
                    print(f"| {n + 1} | {name} | {clients} | {router * 1e3:.1f} |", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


if __name__ == "__main__":
    main()
