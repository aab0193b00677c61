"""One client's 1,000 prompts (16 tokens each), then another client's lone 16-token request 3 s later: how long the
lone one waits. The 1,000 come as one HTTP call, or with `--grpc ADDRESS` as 1,000 Generate calls on one gRPC channel.

    .venv/bin/specfleet serve --http-port 8100 &
    .venv/bin/python scripts/admission_wait.py 8100 [--grpc 127.0.0.1:50051]

docs/benchmarks/admission-turns.md has the numbers."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request


def post(port: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=3600).read())


def many_calls(address: str) -> int:
    """1,000 Generate calls at once on one gRPC channel; how many finished."""
    import grpc

    from specfleet.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="The quick brown fox", max_tokens=16, temperature=0.0)
        futures = [stub.Generate.future(request, timeout=3600) for _ in range(1000)]
        return sum(1 for f in futures if f.result().finish_reason)


def main(port: str, grpc_address: str = "") -> None:
    model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
    big: dict = {}

    def call() -> None:
        started = time.monotonic()
        if grpc_address:
            finished = many_calls(grpc_address)
        else:
            finished = len(post(port, {"model": model, "prompt": ["The quick brown fox"] * 1000, "max_tokens": 16, "temperature": 0})["choices"])
        big.update(seconds=time.monotonic() - started, choices=finished)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(3)
    started = time.monotonic()
    reply = post(port, {"model": model, "prompt": "Das Debian-System ist", "max_tokens": 16, "temperature": 0})
    lone = time.monotonic() - started
    thread.join()
    print(f"lone 16-token request: {lone:.1f} s ({reply['usage']['completion_tokens']} tokens)")
    print(f"the 1,000 prompts: {big['seconds']:.1f} s, {big['choices']} finished")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3] if sys.argv[2:3] == ["--grpc"] else "")
