"""One HTTP call of 1,000 prompts (16 tokens each), then a lone 16-token request 3 s later: how long the lone one waits.

    .venv/bin/specfleet serve --http-port 8100 &
    .venv/bin/python scripts/admission_wait.py 8100

docs/benchmarks/admission-turns.md has the numbers."""

import json, sys, threading, time, urllib.request

port = sys.argv[1]


def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=3600).read())


model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
big_done = {}


def big():
    t = time.monotonic()
    r = post({"model": model, "prompt": ["The quick brown fox"] * 1000, "max_tokens": 16, "temperature": 0})
    big_done["s"] = time.monotonic() - t
    big_done["n"] = len(r["choices"])


th = threading.Thread(target=big)
th.start()
time.sleep(3)
t = time.monotonic()
r = post({"model": model, "prompt": "Das Debian-System ist", "max_tokens": 16, "temperature": 0})
lone = time.monotonic() - t
th.join()
print(
    f"lone 16-token request: {lone:.1f} s (tokens {r['usage']['completion_tokens']}); the 1,000-prompt call: {big_done['s']:.1f} s, {big_done['n']} choices"
)
