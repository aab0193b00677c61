"""`specfleet generate`: one request through a running router over gRPC, its text, and with --stats where its
time went."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet generate", description="Generate text through a running router.")
    parser.add_argument("prompt")
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--stream", action="store_true", help="print text as it is accepted")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0, help="never sample a token below this fraction of the most likely one's probability")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--domain", default="", help="the request's domain, a drafter's speciality label (e.g. code): replaces the router's guess from the prompt"
    )
    parser.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    parser.add_argument(
        "--max-draft-tokens", type=int, default=0, help="at most this many draft tokens per round (0: the router's router.max_draft_tokens)"
    )
    guide = parser.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", help="structured output: the output is JSON following this schema (JSON text)")
    guide.add_argument("--regex", help="structured output: the whole output matches this regular expression")
    guide.add_argument("--choice", action="append", help="structured output: the output is one of these strings (repeatable)")
    guide.add_argument("--grammar", help="structured output: the output derives this EBNF grammar's rule root (xgrammar's dialect)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    parser.add_argument("--stats", action="store_true", help="print speculation stats to stderr")
    parser.add_argument("--ca", help="TLS: the CA certificate (PEM) that signed the router's (security.tls.ca); turns TLS on")
    parser.add_argument("--cert", help="TLS: a client certificate (PEM), for a router with security.tls.client_auth: all")
    parser.add_argument("--key", help="TLS: the client certificate's private key (PEM)")
    return parser


def _channel(args):
    """To the router: TLS with --ca (and a client certificate with --cert and --key), else plaintext."""
    import grpc

    if not args.ca:
        return grpc.insecure_channel(args.server)
    files = [open(path, "rb").read() if path else None for path in (args.ca, args.key, args.cert)]
    return grpc.secure_channel(args.server, grpc.ssl_channel_credentials(*files))


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # The API key comes from the environment only: a command line is visible to every user (`ps`).
    api_key = os.environ.get("SPECFLEET_API_KEY", "")

    import grpc

    from specfleet.v1 import generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        domain=args.domain,
        speculation=generation_pb2.SpeculationOptions(disabled=args.no_speculation, max_draft_tokens=args.max_draft_tokens),
    )
    if args.top_p is not None:
        request.top_p = args.top_p
    if args.seed is not None:
        request.seed = args.seed
    choice = json.dumps(args.choice) if args.choice else None
    for kind, spec in (("json", args.json_schema), ("regex", args.regex), ("choice", choice), ("grammar", args.grammar)):
        if spec is not None:
            request.guide.kind, request.guide.spec = kind, spec
    try:
        channel = _channel(args)
    except OSError as err:
        print(f"specfleet generate: cannot read {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    first_token_s = None
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        try:
            if args.stream:
                final = None
                for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    if first_token_s is None and chunk.token_ids:
                        first_token_s = time.perf_counter() - started
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    final = chunk
                sys.stdout.write("\n")
                stats, reason, tokens = final.speculation, final.finish_reason, final.usage.completion_tokens
            else:
                reply = stub.Generate(request, timeout=args.timeout, metadata=metadata)
                print(reply.text)
                stats, reason, tokens = reply.speculation, reply.finish_reason, reply.usage.completion_tokens
            elapsed_s = time.perf_counter() - started
        except grpc.RpcError as err:
            print(f"specfleet generate: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if args.stats:
        rate = stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0
        print(
            f"[finish: {reason}; rounds: {stats.rounds}; drafts accepted: {stats.accepted_tokens}/{stats.draft_tokens} ({rate:.0%}); "
            f"{tokens} tokens, {tokens / max(1, stats.rounds):.2f} per round (target passes; 1.00 without drafts); "
            f"domain: {stats.domain or '-'}]",
            file=sys.stderr,
        )
        print(_drafters(stats), file=sys.stderr)
        print(_timing(elapsed_s, first_token_s, tokens, stats), file=sys.stderr)
        if stats.draft_wall_ms + stats.verify_wall_ms > elapsed_s * 1e3:
            print(
                "[draft and verify overlap, so they add up to more than the time: the specialists score a new prompt beside its "
                "first verification, and pipelined lanes draft beside another lane's verification]",
                file=sys.stderr,
            )
    return 0


def _drafters(stats) -> str:
    """Which drafters drafted for the request, most rounds first: rounds, and accepted of proposed tokens."""
    drafters = sorted(stats.drafters, key=lambda d: (-d.rounds, d.drafter))
    listed = ", ".join(f"{d.drafter} {d.rounds} rounds {d.accepted_tokens}/{d.draft_tokens} accepted" for d in drafters)
    return f"[drafters: {listed or 'none'}]"


def _timing(elapsed_s: float, first_token_s: float | None, tokens: int, stats) -> str:
    """Where the request's time went, as `generate --stats` prints it: the whole call as this client saw it,
    and the router's draft and verify calls summed over rounds, wall (as the router saw them) split into
    compute (the servers' forward passes, shared with requests batched alongside), queue (the waits for the
    servers' model threads before those passes: their batch queues) and transport (the rest:
    serialisation, gRPC, event loops, waiting for a CPU); then the router's own time in those rounds."""
    per = max(1, tokens)
    first = f"; first token {first_token_s * 1e3:.0f} ms" if first_token_s is not None else ""

    def split(wall: float, compute: float, queue: float) -> str:
        return f"{wall:.0f} ms wall = {compute:.0f} compute + {queue:.0f} queue + {max(0.0, wall - compute - queue):.0f} transport"

    return (
        f"[time: {elapsed_s * 1e3:.0f} ms, {elapsed_s * 1e3 / per:.1f} ms/token, {tokens / elapsed_s if elapsed_s > 0 else 0:.1f} tokens/s{first}; "
        f"draft {split(stats.draft_wall_ms, stats.draft_compute_ms, stats.draft_queue_ms)}; "
        f"verify {split(stats.verify_wall_ms, stats.verify_compute_ms, stats.verify_queue_ms)}; router {stats.router_ms:.0f} ms; "
        f"per token: draft {stats.draft_wall_ms / per:.1f}/{stats.draft_compute_ms / per:.1f} ms, "
        f"verify {stats.verify_wall_ms / per:.1f}/{stats.verify_compute_ms / per:.1f} ms (wall/compute)]"
    )
