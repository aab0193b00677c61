"""What a new session's consecutive blocks cost on a CPU's KV pool: `KVPool.run` (the gap search, `gap_for`, and
taking the blocks) and `release`, on pools of N blocks with live sessions scattered over them.

    .venv/bin/python scripts/kv_gap_cost.py [--before FILE]

`--before`: an older commit's kv.py (`git show REV:specfleet/engine/kv.py > /tmp/kv_before.py`), imported as a
module of its own and timed beside this tree's, a round each in turn, the best of --rounds.
"""

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specfleet.engine import kv  # noqa: E402

# The pool reads only the cache's shape from its model: one layer, one head of one dimension (a small tensor).
MODEL = SimpleNamespace(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"))


def load(path: str):
    spec = importlib.util.spec_from_file_location("kv_before", path)
    module = sys.modules["kv_before"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def pool_with_sessions(module, blocks: int, sessions: int, seed: int):
    """A CPU's pool of `blocks` blocks, `sessions` sessions of 4-32 blocks held where it put them, others since let go."""
    rng = random.Random(seed)
    pool = module.KVPool(MODEL, 16, blocks)
    pool.relocate = True
    live = [pool.run(rng.randint(4, 32)) for _ in range(sessions + sessions // 2)]
    for held in rng.sample(live, len(live) - sessions):
        pool.release(held)
    return pool


def per_session_us(pool, count: int, sessions: int) -> float:
    """Microseconds per new session of `count` blocks: its gap found and taken, then released."""
    start = time.perf_counter()
    for _ in range(sessions):
        pool.release(pool.run(count))
    return (time.perf_counter() - start) / sessions * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a kv.py to time beside this tree's")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1000, 5300, 32768])
    parser.add_argument("--live", type=int, default=16, help="sessions held while new ones come and go")
    parser.add_argument("--count", type=int, default=4, help="blocks of each new session (64 positions)")
    parser.add_argument("--sessions", type=int, default=200, help="new sessions a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    modules = {"after": kv} | ({"before": load(args.before)} if args.before else {})
    columns = ["pool blocks", "free blocks", "free runs"] + [f"{name} us/session" for name in modules] + ["before / after"] * bool(args.before)
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for blocks in args.blocks:
        pools = {name: pool_with_sessions(module, blocks, args.live, seed=blocks) for name, module in modules.items()}
        best = dict.fromkeys(pools, float("inf"))
        for _ in range(args.rounds):
            for name, pool in pools.items():
                best[name] = min(best[name], per_session_us(pool, args.count, args.sessions))
        after = pools["after"]
        cells = [f"{after.blocks:,}", f"{after.free_blocks:,}", str(len(after._runs))] + [f"{best[name]:.1f}" for name in pools]
        ratio = [f"{best['before'] / best['after']:.0f}x"] if args.before else []
        print("| " + " | ".join(cells + ratio) + " |")


if __name__ == "__main__":
    main()
