"""Tensor parallelism's cost and gain on this machine's cores (issue 30's CPU measurement, at the engine).

    PYTHONPATH=. .venv/bin/python scripts/tensor_parallel.py [--repeat 5] [--passes 20]

Two models: the demo target (6 layers, 256 wide, 4 heads) and a larger random Llama (4 layers, 1024 wide,
8 heads, 8 KV heads, intermediate 2816, vocabulary 32,000), float32. Three ways to run each, loaded once and
measured in turn, `--repeat` times (interleaved): one rank on one thread (the default), one rank on two
threads (the same two cores as two ranks), and two ranks of one thread each, their collectives through shared
memory (the default) or gloo. Two passes:
a decode step of 8 sessions of 256 cached positions, and a 512-token prefill. Prints one JSON object per model
and way: the median milliseconds of a pass over the repeats, and their spread (min, max).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import torch

from specfleet.engine import ForwardItem, Session, forward_batch, load_model, prefill

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
# way: (ranks, threads a rank, the CPU ranks' collectives)
WAYS = {
    "1 rank, 1 thread": (1, 1, "shm"),
    "1 rank, 2 threads": (1, 2, "shm"),
    "2 ranks, 1 thread each": (2, 1, "shm"),
    "2 ranks, 1 thread each, gloo": (2, 1, "gloo"),
}


def larger_model(directory: pathlib.Path) -> pathlib.Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    shutil.copytree(DEMO / "tokenizer", directory, dirs_exist_ok=True)
    return directory


def decode_ms(loaded, sessions: list[Session], passes: int) -> float:
    """Milliseconds of one decode pass of every session (nothing committed: each pass is the same)."""
    items = [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in sessions]
    forward_batch(loaded, items)
    started = time.perf_counter()
    for _ in range(passes):
        forward_batch(loaded, items)
    return (time.perf_counter() - started) / passes * 1e3


def prefill_ms(loaded, tokens: list[int], passes: int) -> float:
    total = 0.0
    for _ in range(passes):
        session = Session(token_ids=list(tokens))
        started = time.perf_counter()
        prefill(loaded, [session], keep_last=0)
        total += time.perf_counter() - started
        session.evict_kv()
    return total / passes * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("demo target", DEMO / "target"), ("larger random", larger_model(pathlib.Path(tmp) / "larger"))):
            loaded = {}
            for way, (ranks, threads, collectives) in WAYS.items():
                torch.set_num_threads(threads)
                os.environ["SPECFLEET_TP_CPU_COLLECTIVES"] = collectives
                loaded[way] = load_model(name, path, tensor_parallel_size=ranks, linear="auto")
                loaded[way].prepare(1 << 32, 64)
            vocab = loaded[next(iter(WAYS))].vocab_size
            contexts = [torch.randint(0, vocab, (257,), generator=gen).tolist() for _ in range(8)]
            sessions = {way: [Session(token_ids=list(c)) for c in contexts] for way in WAYS}
            for way, model in loaded.items():
                torch.set_num_threads(WAYS[way][1])
                prefill(model, sessions[way], keep_last=1)
            long_prompt = torch.randint(0, vocab, (512,), generator=gen).tolist()
            times = {way: {"decode": [], "prefill": []} for way in WAYS}
            for _ in range(args.repeat):
                for way, model in loaded.items():
                    torch.set_num_threads(WAYS[way][1])
                    times[way]["decode"].append(decode_ms(model, sessions[way], args.passes))
                    times[way]["prefill"].append(prefill_ms(model, long_prompt, max(1, args.passes // 5)))
            for way, measured in times.items():
                row = {"model": name, "way": way}
                for kind, values in measured.items():
                    row[f"{kind}_ms"] = round(statistics.median(values), 2)
                    row[f"{kind}_spread"] = [round(min(values), 2), round(max(values), 2)]
                print(json.dumps(row), flush=True)
            for model in loaded.values():
                model.close()


if __name__ == "__main__":
    main()
