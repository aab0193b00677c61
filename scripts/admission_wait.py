"""One HTTP call of 1,000 prompts (16 tokens each), then a lone 16-token request 3 s later: how long the lone one waits.

    .venv/bin/specfleet serve --http-port 8100 &
    .venv/bin/python scripts/admission_wait.py 8100

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


def main(port: str) -> None:
    model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
    big: dict = {}

    def call() -> None:
        started = time.monotonic()
        reply = post(port, {"model": model, "prompt": ["The quick brown fox"] * 1000, "max_tokens": 16, "temperature": 0})
        big.update(seconds=time.monotonic() - started, choices=len(reply["choices"]))

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(3)
    started = time.monotonic()
    reply = post(port, {"model": model, "prompt": "Das Debian-System ist", "max_tokens": 16, "temperature": 0})
    lone = time.monotonic() - started
    thread.join()
    print(f"lone 16-token request: {lone:.1f} s ({reply['usage']['completion_tokens']} tokens)")
    print(f"the 1,000-prompt call: {big['seconds']:.1f} s, {big['choices']} choices")


if __name__ == "__main__":
    main(sys.argv[1])
