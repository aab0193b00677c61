"""From logits to the distributions that drafters draw from and the target verifies against.

Both sides shape logits the same way, exactly as the user asked: temperature,
then top-k, then top-p. Temperature 0 is greedy: a point mass on the argmax
(ties go to the lowest token id, as torch.argmax does).

Randomness is derived from (seed, position, stream) rather than kept in
per-session generator state, so a request's random draws do not depend on how
it was batched or whether its cache was evicted, and every round of a request
uses fresh draws (each round commits at least one token, so positions differ).

Drafter-invariant sessions (a client-given seed) draw every token by an
exponential race, argmax_v p(v) / E(v), with E(v) ~ Exp(1) a pure function of
(seed, position, token id) computed with integer arithmetic (`race_noise`), so
drafters and verifier on any devices see the same noise: the seed alone fixes
each emitted token, and a drafter that races its own q against the same noise
proposes that token whenever it can.

Shapes: B sessions, V vocabulary, K entries kept in a sparse distribution.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from specfleet.engine import cpu_kernels
from specfleet.sampling import GREEDY_BELOW, STREAM_RACE


def probs_from_logits(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B]; 0 means greedy
    top_k: torch.Tensor,  # [B] int; 0 means no limit
    top_p: torch.Tensor,  # [B]; 1 means no limit
    min_p: torch.Tensor | None = None,  # [B]; 0 (or None for all rows) means no limit
) -> torch.Tensor:  # [B, V] float32, rows sum to 1
    logits = logits.float()
    batch, vocab = logits.shape
    greedy = temperature < GREEDY_BELOW
    if greedy.all():
        return _one_hot(logits)
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    if min_p is not None and bool((min_p > 0).any()):
        # vLLM's order: min-p on the tempered distribution, before top-k and top-p. p_i < min_p * p_max compared as
        # logits (softmax's normaliser cancels): scaled_i < scaled_max + log(min_p); min_p = 0 keeps every token.
        floor = scaled.max(dim=1, keepdim=True).values + min_p.clamp(min=1e-30).log().unsqueeze(1)
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0).unsqueeze(1), float("-inf"))
    if bool(((top_k <= 0) | (top_k >= vocab)).all() and (top_p >= 1).all()):
        # No truncation asked for: the sort below would change nothing, and it is the costly part.
        probs = scaled.softmax(dim=1)
    else:
        # Stable: tied tokens keep id order, so truncation keeps the lower ids on every device.
        sorted_logits, sorted_ids = scaled.sort(dim=1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device).expand(batch, vocab)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        drop = rank >= k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p. The top token is always kept.
        mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
        # Only rows that ask for top-p: float32 mass reaches 1.0 before the tail ends, and a row
        # without top-p must keep its whole support whatever it is batched with.
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.zeros_like(scaled).scatter_(1, sorted_ids, sorted_logits.softmax(dim=1))
    if not greedy.any():  # a sampled batch: the argmax's point masses would be computed to be discarded
        return probs
    return torch.where(greedy.unsqueeze(1), _one_hot(logits), probs)


def _one_hot(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] the point mass on each row's argmax."""
    return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)


def truncate(probs: torch.Tensor, max_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The max_entries most likely tokens of each row, renormalised: [B, K] ids and probs.

    Drafters sample from this truncated distribution, never from the full one, so
    that the sparse distribution they send is exactly the one they drew from.
    Entries with probability 0 are kept with probability 0.
    """
    k = min(max_entries, probs.shape[1])
    top_probs, top_ids = probs.topk(k, dim=1)
    return top_ids, top_probs / top_probs.sum(dim=1, keepdim=True)


def generator_for(seed: int, position: int, stream: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator whose draws depend only on (seed, position, stream)."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed & (2**64 - 1), position, stream), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return gen


def sample_sparse(ids: torch.Tensor, probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from sparse distributions [B, K]; row b uses generators[b]."""
    picks = torch.stack([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])
    return ids.gather(1, picks).squeeze(1)


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic): products wrap
# modulo 2^64 on every device, so the bits match a uint64 implementation.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def race_keys(seeds: list[int], positions: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """[R] int64: one key per (seed, position) row of an exponential race."""
    keys = []
    for seed, position in zip(seeds, positions):
        digest = hashlib.blake2b(struct.pack("<QQQ", seed & (2**64 - 1), position, STREAM_RACE), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.long, device=device)


def race_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [R, M] float64 for token ids [R, M] (or [M], shared by every row) under keys [R].

    A pure function of (key, id), computed with splitmix64 in int64 arithmetic: the same
    bits on CPU and GPU, for the whole vocabulary or any subset of it, so a drafter
    scoring a few ids and the verifier scoring all of them race with the same noise.
    """
    x = keys.unsqueeze(1) + (ids.to(keys.device) + 1) * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    # 53 random bits, centred in their interval, give a uniform strictly inside (0, 1).
    uniform = (_shift_right(x, 11).double() + 0.5) * 2.0**-53
    return -torch.log(uniform)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[R] index of the race winner argmax p / E per row: distributed as p when E ~ Exp(1) i.i.d."""
    return (probs.double() / noise).argmax(dim=-1)


def race_vocabulary(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R] each row's race over every token: `race(probs, race_noise(keys, all ids))` for probs [R, V] and keys [R].
    On a CPU with the compiled kernels, csrc/race.cpp's one pass a row (the same winners,
    tests/engine/test_cpu_kernels.py), where the tensor form's [R, V] temporaries cost more than the verify pass's
    forward at a few sessions (docs/benchmarks/verify-overhead.md)."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and cpu_kernels.library() is not None:
        return cpu_kernels.race(probs, keys)
    return race(probs, race_noise(keys, torch.arange(probs.shape[1], device=probs.device)))
