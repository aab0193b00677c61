"""A model's KV memory: the paged pool, prefix caching, and one session's cache in it.

A session is a growing list of token ids plus a KV cache for a prefix of them, in blocks of
the pool. Caches extend incrementally and roll back rejected positions; the services'
`SessionStore` (sessions.py) evicts them least-recently-used under a memory budget, and an
evicted cache is rebuilt from the session's token ids on its next use (`runner.prefill`), so
eviction never changes output.
"""

from __future__ import annotations

import array
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specfleet.engine.free_runs import FreeRuns
from specfleet.engine.llama import LlamaModel
from specfleet.engine.prompt_logprobs import PromptLogprobs

log = logging.getLogger(__name__)

# Positions a block holds: what a session's memory is rounded up to.
BLOCK_SIZE = 16
# Blocks a new pool holds; it doubles (one copy) when a session needs more than are free.
INITIAL_BLOCKS = 64


class KVPool:
    """The KV memory of one model: blocks of `block_size` positions on one token axis.

    `kv` is [layers, 2, KV heads, blocks x block_size, D] on the model's device. A session
    holds a list of blocks (its block table); position p of the session lies at
    `blocks[p // block_size] * block_size + p % block_size` of the token axis. Memory is
    proportional to the positions sessions hold, rounded up to a block each.

    Why one token axis rather than [blocks, block_size]: a session whose blocks are
    consecutive is one range of the axis, which attention reads as a view, nothing
    gathered (`llama.forward`). On a CPU, where gathering scattered blocks at every layer
    of every pass costs more than the pass's attention, the pool keeps every session
    consecutive (`relocate`): a session grows into the block after its last one, a new run
    starts in the middle of the largest free gap (leaving the session before it room to
    grow), one that cannot grow in place moves to a gap that holds it (one copy of its
    cache), and the pool doubles when no gap does. The free blocks are kept as runs too
    (`FreeRuns`, updated as blocks are taken and freed), so a gap is found in a step per
    run, about one per session, not by sorting every free block (a pool grown to its budget
    holds thousands). Elsewhere (a GPU, whose batched attention gathers through block tables
    anyway) a session takes the block after its last where it is free, else any free
    blocks, with no search.
    Block 0 is the pool's scratch: never handed out, it is where padding reads (masked)
    and a CUDA graph's padding rows write.

    Prefix caching (`prefix_caching`): a block whose positions are all cached is known by the
    hash of its tokens and of every token before them (`block_hash`), and a new session whose
    tokens start the same way takes those blocks rather than computing them (`match`), shared
    and counted (a block goes back to the pool when no session holds it). A cached block is
    never written again: a session that rolls back into one gives it up and recomputes the
    positions it kept of it. When no session holds a cached block it stays cached, idle, until
    the pool needs its room (least recently released first) and has grown to its services' KV
    budget (`cache_budget`).
    """

    def __init__(self, model: LlamaModel, block_size: int = BLOCK_SIZE, blocks: int = INITIAL_BLOCKS, prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"a KV block holds at least one position, not {block_size}")
        self.block_size = block_size
        self.kv = torch.zeros(model.num_layers, 2, model.kv_heads, blocks * block_size, model.head_dim, dtype=model.dtype, device=model.device)
        self._free: set[int] = set()
        self._runs = FreeRuns()  # the same blocks as runs of consecutive blocks: `gap_for` reads them
        self._mark_free(range(1, blocks))
        self._refs: dict[int, int] = {}  # held blocks: how many sessions hold each
        self.prefix_caching = prefix_caching
        self._cached: dict[bytes, int] = {}  # a full block's hash -> the block holding its KV
        self._hash_of: dict[int, bytes] = {}  # the other way: the cached blocks, never written again
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no session holds, least recently released first
        # Blocks the pool grows to before it forgets idle cached blocks to make room: its services' KV budget
        # (`add_budget`). A pool sized by its sessions would otherwise keep only a few prompts' worth of idle blocks,
        # and a conversation's next turn would find its earlier turns forgotten.
        self.cache_budget = 0
        self.queries = self.hits = 0  # tokens looked up in the prefix cache, and found (vLLM's prefix_cache_queries, _hits)
        self.block_bytes = model.num_layers * 2 * model.kv_heads * block_size * model.head_dim * self.kv.element_size()
        # Moving a session to keep it consecutive pays where attention reads views (a CPU, per session).
        self.relocate = model.device.type == "cpu"
        self.relocations = 0
        # Bumped when the pool's tensor is replaced (growth): captured CUDA graphs hold the old one.
        self.generation = 0
        # Tensor parallelism's rank 0: the copies and growth of `kv` since the last pass, which the other ranks
        # replay on their heads' KV before it (`parallel.py`); None elsewhere.
        self.log: list[tuple] | None = None

    @property
    def blocks(self) -> int:
        return self.kv.shape[3] // self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def held_blocks(self) -> int:
        """Blocks some session holds (a shared one once)."""
        return len(self._refs)

    def add_budget(self, max_cache_bytes: int) -> None:
        """A service's KV budget for the sessions this pool holds (a stack's members each add theirs)."""
        self.cache_budget += max_cache_bytes // self.block_bytes

    def _make_room(self, count: int, enough) -> None:
        """Room for `count` more blocks, `enough()` saying when there is: the pool grown (doubling, at least `count`
        more) within its cache budget where idle cached blocks stand in the way, rather than forget them; else idle
        blocks forgotten, least recently released first; else the pool grown past the budget."""
        if self._idle and self.blocks < self.cache_budget:
            self._grow(min(self.cache_budget, max(2 * self.blocks, self.blocks + count)))
        self._reclaim(enough)
        if not enough():
            self._grow(max(2 * self.blocks, self.blocks + count))

    def reserve(self, blocks: int) -> None:
        """Hold at least `blocks` blocks now (one allocation up front, as a GPU serving a budget wants)."""
        if blocks > self.blocks:
            self._grow(blocks)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` free blocks, following block `after` where those are free, else consecutive where a gap holds them."""
        if count <= 0:
            return []
        if self.free_after(after, count):
            return self.take(range(after + 1, after + 1 + count))
        if not self.relocate:  # any free blocks: batched attention gathers them anyway, and no gap is searched for
            if len(self._free) < count:
                self._make_room(count, lambda: len(self._free) >= count)
            return self.take([self._free.pop() for _ in range(count)])  # `take` tells the runs
        return self.run(count)

    def free_after(self, after: int | None, count: int) -> bool:
        """Whether the `count` blocks following block `after` are free (a session ending there grows in place)."""
        return after is not None and all(b in self._free for b in range(after + 1, after + 1 + count))

    def run(self, count: int) -> list[int]:
        """`count` consecutive free blocks: in the gap `gap_for` picks, room made (`_make_room`) where none holds them."""
        start = self.gap_for(count)
        if start is None:
            self._make_room(count, lambda: self.gap_for(count) is not None)
            start = self.gap_for(count)
        return self.take(range(start, start + count))

    def release(self, blocks: list[int]) -> None:
        """A session lets these blocks go: free once no session holds them (idle, if cached).

        Not zeroed: positions past a session's length are masked, and every value here is a finite
        key or value written by some pass (or the zeros of allocation), so masked reads add 0."""
        freed = []
        for b in blocks:
            refs = self._refs.pop(b, 1) - 1
            if refs > 0:
                self._refs[b] = refs
            elif b in self._hash_of:
                self._idle[b] = None
            else:
                freed.append(b)
        self._mark_free(freed)

    def take(self, blocks) -> list[int]:
        taken = list(blocks)
        self._mark_taken(taken)
        self._refs.update(dict.fromkeys(taken, 1))
        return taken

    def _mark_free(self, blocks) -> None:
        """These blocks are free now: in the free set, and in its runs."""
        self._free.update(blocks)
        self._runs.add(blocks)

    def _mark_taken(self, blocks: list[int]) -> None:
        """These free blocks are held now (the runs are told even where the caller already popped them from the set)."""
        self._free.difference_update(blocks)
        self._runs.remove(blocks)

    def _reclaim(self, enough) -> None:
        """Forget idle cached blocks, least recently released first, until `enough()` (or none is left)."""
        while self._idle and not enough():
            forgotten = []
            for _ in range(min(len(self._idle), 16)):
                b, _ = self._idle.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
                forgotten.append(b)
            self._mark_free(forgotten)  # before `enough()` asks again, which may look for a gap

    def match(self, tokens: list[int], limit: int, namespace: bytes = b"") -> tuple[list[int], list[bytes]]:
        """The cached blocks (taken, shared) holding the longest run of full blocks that `tokens[:limit]` starts with,
        and their hashes; `namespace`: the model's, where several models' sessions share the pool (`Session.namespace`)."""
        blocks, hashes = [], []
        bs = self.block_size
        for i in range(limit // bs):
            h = block_hash(hashes[-1] if hashes else namespace, tokens[i * bs : (i + 1) * bs])
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            if self._idle.pop(b, 0) is None:  # idle until now: held again
                self._refs[b] = 1
            else:
                self._refs[b] += 1
        self.queries += limit
        self.hits += len(blocks) * bs
        return blocks, hashes

    def register(self, session: "Session") -> None:
        """Cache the session's full blocks it has not hashed yet (its cache holds `token_ids[:kv_len]`)."""
        bs = self.block_size
        for i in range(len(session.hashes), session.kv_len // bs):
            h = block_hash(session.hashes[-1] if session.hashes else session.namespace, session.token_ids[i * bs : (i + 1) * bs])
            b = session.blocks[i]
            if h not in self._cached and b not in self._hash_of:
                self._cached[h], self._hash_of[b] = b, h
            session.hashes.append(h)

    def cached(self, block: int) -> bool:
        """Whether the block's KV is in the prefix cache: then no pass writes it again."""
        return block in self._hash_of

    def gap_for(self, count: int) -> int | None:
        """Where `count` consecutive free blocks start: in the largest free gap, past its middle when a
        session's blocks precede it (room for that one to grow), else at its start; None if no gap fits."""
        best = self._runs.largest(count)  # ties: the lowest start
        if best is None:
            return None
        start, length = best
        # Runs are maximal, so the block before one is never free: only block 0, the scratch, never grows into the next.
        if start == 1:
            return start
        return start + (length - count) // 2

    def move(self, blocks: list[int], to: list[int], length: int) -> None:
        """Copy positions [0, length) of a session from `blocks` to `to` (same order), in one indexed copy.

        A cached block the session alone holds hands its hash to its copy: the session's prefix stays cached where
        its KV now lives, and the old block, released next, is free rather than idle. Left cached there, the old
        block would be the first the pool forgets, and with it every later block of the prefix (a block is known
        by the hash of all before it). A block shared with another session stays cached where it is."""
        self.copy(self.index(blocks, length), self.index(to, length))
        self.relocations += 1
        for old, new in zip(blocks, to):
            h = self._hash_of.get(old)
            if h is not None and self._refs.get(old) == 1:
                del self._hash_of[old]
                self._cached[h], self._hash_of[new] = new, h

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Positions `src` of the token axis to positions `dst`, in one indexed copy."""
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        if self.log is not None:
            self.log.append(("copy", src.tolist(), dst.tolist()))

    def replay(self, ops: list[tuple]) -> None:
        """Another rank's `log`, on this pool: its growth and its copies, in order."""
        for op in ops:
            if op[0] == "grow":
                self.reserve(op[1])
            else:
                self.copy(torch.tensor(op[1], device=self.kv.device), torch.tensor(op[2], device=self.kv.device))

    def index(self, blocks: list[int], length: int) -> torch.Tensor:
        """[length] long on the pool's device: where positions [0, length) of a session holding `blocks` lie."""
        bs = self.block_size
        table = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        return (table[:, None] * bs + torch.arange(bs, device=self.kv.device)).view(-1)[:length]

    def _grow(self, blocks: int) -> None:
        old = self.kv
        shape = list(old.shape)
        shape[3] = blocks * self.block_size
        self.kv = torch.zeros(shape, dtype=old.dtype, device=old.device)
        self.kv[:, :, :, : old.shape[3]] = old
        self._mark_free(range(old.shape[3] // self.block_size, blocks))  # joins a free run at the old end
        self.generation += 1
        if self.log is not None:
            self.log.append(("grow", blocks))


def block_hash(previous: bytes, tokens: list[int]) -> bytes:
    """A full block's identity: its tokens and (through `previous`, the hash of the block before it) every token before them."""
    return hashlib.blake2b(previous + array.array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # Positions [0, kv_len) of the cache lie in `blocks` of `pool` (KVPool's layout); no blocks, no cache.
    pool: KVPool | None = None
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # with prefix caching: the hashes of its first full blocks
    # Where its first block's hash starts from: its model's name where models share a pool (a stack), so that one
    # model's session never takes another's cached blocks.
    namespace: bytes = b""
    used_at: float = 0.0  # time.monotonic() of the last call that synced it (SessionStore.expire_idle)
    # Of its prompt, the tokens its first lookup in the prefix cache found (vLLM's cached_tokens); None before it.
    cached_tokens: int | None = None
    # While a verifier owes its client the prompt's log-probabilities: prefill records them and skips the prefix cache.
    prompt_logprobs: PromptLogprobs | None = None
    # A guided session's grammar matcher after its output (specfleet/engine/guides.py `session_guide`).
    guide_state: object | None = None

    def place(self) -> int | torch.Tensor:
        """Where the cache lies on the pool's token axis: its first position's index when its blocks are
        consecutive (a range, read as a view), else every held position's index ([blocks x block size])."""
        first = self.blocks[0]
        if self.blocks[-1] - first == len(self.blocks) - 1 and all(b == first + i for i, b in enumerate(self.blocks)):
            return first * self.pool.block_size
        return self.pool.index(self.blocks, len(self.blocks) * self.pool.block_size)

    def kv_bytes(self) -> int:
        return 0 if self.pool is None else len(self.blocks) * self.pool.block_bytes

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        if length < self.kv_len:
            bs = self.pool.block_size
            del self.hashes[length // bs :]
            # A cached block is never written again: rolled back into, it is given up and its kept positions recomputed.
            self.kv_len = length if length % bs == 0 or not self.pool.cached(self.blocks[length // bs]) else length - length % bs
            self._trim()

    def reserve(self, pool: KVPool, count: int, limit: int) -> None:
        """Make room for `count` positions past the cached prefix, in blocks of `pool`; at most `limit` positions in all."""
        if self.kv_len + count > limit:
            raise ValueError(f"a session of {self.kv_len + count} positions exceeds the model's {limit}")
        self.pool = pool
        if pool.prefix_caching:
            pool.register(self)
        need = -(-(self.kv_len + count) // pool.block_size) - len(self.blocks)
        if need <= 0:
            return
        after = self.blocks[-1] if self.blocks else None
        if after is not None and pool.relocate and self.kv_len and not pool.free_after(after, need):
            # Cannot grow in place: move to a gap that holds all of it rather than be read scattered.
            moved = pool.run(len(self.blocks) + need)
            pool.move(self.blocks, moved[: len(self.blocks)], self.kv_len)
            pool.release(self.blocks)
            self.blocks = moved
            return
        self.blocks += pool.allocate(need, after)

    def commit(self, rows: list[int]) -> None:
        """Keep these of the positions the last forward pass wrote past the cached prefix, in this order."""
        if rows != list(range(len(rows))):
            index = self.pool.index(self.blocks, len(self.blocks) * self.pool.block_size)
            src = index[torch.tensor(rows, device=index.device) + self.kv_len]
            self.pool.copy(src, index[self.kv_len : self.kv_len + len(rows)])
        self.kv_len += len(rows)
        self._trim()

    def _trim(self) -> None:
        """Free the blocks past the cached prefix: a rollback gives whole blocks back."""
        keep = -(-self.kv_len // self.pool.block_size) if self.pool is not None else 0
        if len(self.blocks) > keep:
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def reuse_prefix(self, pool: KVPool, end: int) -> None:
        """With no cache yet, take the cached blocks its first `end` tokens start with (prefix caching)."""
        if pool.prefix_caching and not self.blocks:
            self.pool = pool
            self.blocks, self.hashes = pool.match(self.token_ids, end, self.namespace)
            self.kv_len = len(self.blocks) * pool.block_size
            if self.cached_tokens is None:
                self.cached_tokens = self.kv_len

    def evict_kv(self) -> None:
        if self.blocks:
            self.pool.release(self.blocks)
        self.blocks, self.hashes = [], []
        self.pool = None
        self.kv_len = 0
