"""What structured output costs through `specfleet serve` (the demo default), beside unguided requests.

Starts `specfleet serve` with the bundled models and no config (pinned to the given cores), then sends the same
prompts through the OpenAI API, greedy, one client, in interleaved passes: unguided, with a guide that allows every
token (the same outputs: what guiding costs) and with a `json_schema` without whitespace (vLLM's
`disable_any_whitespace`: whether drafting pays under it), each with speculation on (the default) and off. Prints
per pass each way's completion tokens per second of wall time and accepted draft tokens per verification round (the
`speculation` extra field), then per way the median over passes of its ratio to the unguided requests and to the
same way with speculation off, in the same pass, and the verifier's compute per output token.

    .venv/bin/python scripts/guided_throughput.py --cpus 0 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import openai

PROMPTS = [
    "Describe the project as JSON:",
    "def parse(line):",
    "The weather today in Berlin is",
    "A list of the planets:",
    "Der schnelle braune Fuchs",
    "name: specfleet\nversion:",
    "SELECT name FROM users WHERE",
    "Once upon a time",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}
COMPACT = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "project", "schema": SCHEMA}},
    # vLLM's option: no whitespace between JSON tokens, where a small model otherwise fills max_tokens with it.
    "extra_body": {"structured_outputs": {"disable_any_whitespace": True}},
}
OFF = {"speculation": {"disabled": True}}
# A guide that allows every token: the same outputs as unguided requests, so the difference is what guiding costs.
EVERYTHING = {"extra_body": {"structured_outputs": {"regex": "(.|\\n)*"}}}
# Each way with speculation as `specfleet serve` ships it and with it off.
WAYS = {
    "unguided": {},
    "unguided, speculation off": {"extra_body": OFF},
    "guide allowing every token": EVERYTHING,
    "guide allowing every token, speculation off": {"extra_body": {**EVERYTHING["extra_body"], **OFF}},
    "json_schema compact": COMPACT,
    "json_schema compact, speculation off": {**COMPACT, "extra_body": {**COMPACT["extra_body"], **OFF}},
}


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"specfleet serve did not answer {url}/health in {timeout_s:.0f}s")


def one_pass(client: openai.OpenAI, way: dict, max_tokens: int) -> tuple[float, float, int, float]:
    """(completion tokens per second, accepted tokens per round, replies that are complete JSON, the verifier's
    compute per token in ms) over PROMPTS, one request at a time."""
    tokens = accepted = rounds = parsed = compute_ms = 0
    started = time.perf_counter()
    for prompt in PROMPTS:
        reply = client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens, **way
        )
        tokens += reply.usage.completion_tokens
        parsed += reply.choices[0].finish_reason == "stop" and _parses(reply.choices[0].message.content)
        for stats in reply.model_extra["speculation"]:
            accepted += stats.get("accepted_tokens", 0)
            rounds += stats.get("rounds", 0)
            compute_ms += stats.get("verify_compute_ms", 0)
    return tokens / (time.perf_counter() - started), accepted / max(1, rounds), parsed, compute_ms / tokens


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", default="0", help="cores for specfleet serve (taskset list)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--http-port", type=int, default=8317)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.http_port}"
    command = ["taskset", "-c", args.cpus, os.path.join(os.path.dirname(sys.executable), "specfleet"), "serve"]
    command += ["--http-port", str(args.http_port), "--port", str(args.http_port + 1)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, 300)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        for way in WAYS.values():  # warm-up: grammars compiled, caches filled
            one_pass(client, way, 8)
        results = {name: [] for name in WAYS}
        for n in range(args.repeat):
            for name, way in WAYS.items():
                results[name].append(one_pass(client, way, args.max_tokens))
            print(f"pass {n + 1}: " + "; ".join(f"{name} {r[-1][0]:.0f} tok/s, {r[-1][1]:.2f} accepted/round" for name, r in results.items()))
        for name, runs in results.items():
            ratios = [mine[0] / base[0] for mine, base in zip(runs, results["unguided"])]
            off = results.get(f"{name}, speculation off")
            versus_off = f", x speculation off {statistics.median(m[0] / b[0] for m, b in zip(runs, off)):.2f}" if off else ""
            print(
                f"{name}: tok/s {' / '.join(f'{r[0]:.0f}' for r in runs)}, accepted/round "
                f"{' / '.join(f'{r[1]:.2f}' for r in runs)}, x unguided (median of passes) {statistics.median(ratios):.2f}{versus_off}; "
                f"complete JSON {runs[-1][2]} of {len(PROMPTS)}; verifier compute "
                f"{statistics.median(r[3] for r in runs):.3f} ms a token (median)"
            )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
