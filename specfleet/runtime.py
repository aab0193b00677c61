"""Model runtime shared by drafters and the verifier: loading, session KV caches, batched forward.

A session is a growing list of token ids plus a KV cache for a prefix of them.
Caches extend incrementally, roll back rejected positions, and are evicted
least-recently-used under a memory budget; an evicted cache is rebuilt from
the session's token ids on its next use, so eviction never changes output.

`forward_batch` runs many sessions in one forward pass. Their past KV caches
have different lengths; they are left-padded to a common length and masked
out, and each session's new tokens carry their own attention pattern (causal
for a chain, ancestor-only for a token tree) and position ids.

Shapes: B sessions; L past length (padded); N new tokens (padded); H KV heads;
D head dim; V vocabulary.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import pathlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def configure_torch(threads: int) -> None:
    # One thread per model process: with two threads and another busy process on a
    # 2-core machine, latency spiked 10-100x.
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens: equal iff token ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id}
    payload = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


@dataclass
class LoadedModel:
    name: str
    path: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_id: int
    parameters: int
    num_layers: int

    def info(self):
        """This model as the contract's ModelInfo (what GetInfo answers)."""
        from specfleet.v1 import common_pb2

        return common_pb2.ModelInfo(
            name=self.name,
            path=self.path,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_id=self.eos_token_id,
            tokenizer_fingerprint=self.fingerprint,
            parameters=self.parameters,
        )


def load_model(name: str, path: str | os.PathLike, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a Hugging Face causal LM and its tokenizer from a local directory, offline."""
    from transformers import AutoModelForCausalLM

    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model '{name}': no config.json in {path}; expected a Hugging Face model directory")
    if dtype not in DTYPES:
        raise ValueError(f"model '{name}': dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    started = time.perf_counter()
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype])
    model.to(device).eval()
    config = model.config.get_text_config(decoder=True)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    loaded = LoadedModel(
        name=name,
        path=str(path),
        model=model,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=int(config.vocab_size),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_id=int(eos) if eos is not None else -1,
        parameters=sum(p.numel() for p in model.parameters()),
        num_layers=int(config.num_hidden_layers),
    )
    log.info(
        "loaded model %s from %s: %.1fM parameters, %s, %.1fs",
        name, path, loaded.parameters / 1e6, dtype, time.perf_counter() - started,
    )
    return loaded


# --- sessions -------------------------------------------------------------------------------------------------


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # Per layer (keys, values) buffers, each [H, capacity, D]; the first kv_len positions
    # hold the KV of token_ids[:kv_len]. Spare capacity makes appending a write, not a copy.
    _buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (keys, values), each [H, kv_len, D]; None when evicted."""
        if self._buffers is None:
            return None
        return [(k[:, : self.kv_len], v[:, : self.kv_len]) for k, v in self._buffers]

    def kv_bytes(self) -> int:
        if self._buffers is None:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._buffers)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        self.kv_len = min(self.kv_len, length)

    def append_kv(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        """Extend the cache by `count` positions whose KV is new_kv ([H, count, D] per layer)."""
        needed = self.kv_len + count
        if self._buffers is None:
            if self.kv_len != 0:
                raise AssertionError("an evicted session must be rebuilt from position 0")
            self._buffers = [(self._alloc(k, needed), self._alloc(v, needed)) for k, v in new_kv]
        elif needed > self._buffers[0][0].shape[1]:
            grown = []
            for k, v in self._buffers:
                nk, nv = self._alloc(k, needed), self._alloc(v, needed)
                nk[:, : self.kv_len] = k[:, : self.kv_len]
                nv[:, : self.kv_len] = v[:, : self.kv_len]
                grown.append((nk, nv))
            self._buffers = grown
        for (k, v), (nk, nv) in zip(self._buffers, new_kv):
            k[:, self.kv_len : needed] = nk
            v[:, self.kv_len : needed] = nv
        self.kv_len = needed

    @staticmethod
    def _alloc(like: torch.Tensor, needed: int) -> torch.Tensor:
        # Room to grow: doubling keeps appends amortised O(1) per position.
        capacity = max(64, 1 << (needed - 1).bit_length())
        return like.new_empty(like.shape[0], capacity, like.shape[2])

    def evict_kv(self) -> None:
        self._buffers = None
        self.kv_len = 0


class SessionStore:
    """Sessions by id, least recently used first.

    Two budgets: `max_cache_bytes` of KV (over it, the least recently used
    sessions lose their KV but keep their token ids) and `max_sessions` (over
    it, the least recently used sessions are forgotten; their clients get
    SESSION_UNKNOWN and resend the full token ids).
    """

    def __init__(self, max_cache_bytes: int, max_sessions: int):
        self.max_cache_bytes = max_cache_bytes
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evictions = 0
        # Held by the model thread for a whole batch, so a release never races a batch using the session.
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sessions)

    def sync(self, session_id: str, prefix_length: int, new_token_ids: list[int]) -> Session:
        """Apply a client's SessionSync: keep prefix_length tokens, append new ones."""
        session = self._sessions.get(session_id)
        if prefix_length == 0:
            if session is None:
                session = Session(token_ids=[])
                self._sessions[session_id] = session
            session.truncate(0)
        elif session is None or len(session.token_ids) < prefix_length:
            raise UnknownSession(session_id)
        else:
            session.truncate(prefix_length)
        session.token_ids.extend(new_token_ids)
        self._sessions.move_to_end(session_id)
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def release(self, session_ids: list[str], keep_tokens: bool) -> int:
        with self.lock:
            return self._release(session_ids, keep_tokens)

    def _release(self, session_ids: list[str], keep_tokens: bool) -> int:
        released = 0
        for sid in session_ids:
            session = self._sessions.get(sid)
            if session is None:
                continue
            released += 1
            if keep_tokens:
                session.evict_kv()
            else:
                del self._sessions[sid]
        return released

    def enforce_budget(self, protect: set[str] = frozenset()) -> None:
        """Evict least recently used sessions until within budget; `protect` ids are in use now."""
        while len(self._sessions) > self.max_sessions:
            victim = next((sid for sid in self._sessions if sid not in protect), None)
            if victim is None:
                break
            del self._sessions[victim]
            self.evictions += 1
        total = sum(s.kv_bytes() for s in self._sessions.values())
        for sid, session in self._sessions.items():
            if total <= self.max_cache_bytes:
                break
            if sid in protect or session.kv_bytes() == 0:
                continue
            total -= session.kv_bytes()
            session.evict_kv()
            self.evictions += 1


# --- batched forward --------------------------------------------------------------------------------------------


@dataclass
class ForwardItem:
    """One session's part of a batched forward pass."""

    session: Session
    input_ids: list[int]  # new tokens fed this pass (n of them)
    positions: list[int]  # their position ids
    attend: torch.Tensor | None = None  # [n, n] bool: new token i may attend to new token j; None = causal


@torch.inference_mode()
def forward_batch(loaded: LoadedModel, items: list[ForwardItem]) -> tuple[torch.Tensor, list]:
    """One forward pass over many sessions.

    Returns logits [B, N, V] (row b valid for its first n_b positions) and, per
    item, the new KV per layer as (keys, values), each [H, n_b, D]. The caller
    decides which of the new positions to keep in the session's cache.
    """
    from transformers import DynamicCache

    model = loaded.model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    batch = len(items)
    past_lens = [it.session.kv_len for it in items]
    new_lens = [len(it.input_ids) for it in items]
    max_past, max_new = max(past_lens), max(new_lens)

    input_ids = torch.zeros(batch, max_new, dtype=torch.long)
    position_ids = torch.zeros(batch, max_new, dtype=torch.long)
    allowed = torch.zeros(batch, max_new, max_past + max_new, dtype=torch.bool)
    for b, it in enumerate(items):
        n = new_lens[b]
        input_ids[b, :n] = torch.tensor(it.input_ids)
        position_ids[b, :n] = torch.tensor(it.positions)
        allowed[b, :n, max_past - past_lens[b] : max_past] = True
        attend = it.attend if it.attend is not None else torch.ones(n, n, dtype=torch.bool).tril()
        allowed[b, :n, max_past : max_past + n] = attend
        # Padding queries attend to themselves only, so softmax never sees an empty row.
        idx = torch.arange(n, max_new)
        allowed[b, idx, max_past + idx] = True
    mask = torch.zeros(batch, 1, max_new, max_past + max_new, dtype=dtype)
    mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)

    cache = DynamicCache(config=model.config)
    if max_past > 0:
        pasts = [it.session.kv for it in items]
        ref_past = next(p for p in pasts if p is not None)
        for layer_idx, layer in enumerate(cache.layers):
            keys, values = [], []
            for b, past in enumerate(pasts):
                pad = max_past - past_lens[b]
                if past is None:
                    ref = ref_past[layer_idx][0]
                    k = v = ref.new_zeros(ref.shape[0], max_past, ref.shape[2])
                else:
                    k, v = past[layer_idx]
                    if pad:
                        k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                        v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                keys.append(k)
                values.append(v)
            # Hand the layer its past directly: DynamicCache's own constructor would copy it once more.
            k_all = keys[0].unsqueeze(0) if batch == 1 else torch.stack(keys)
            v_all = values[0].unsqueeze(0) if batch == 1 else torch.stack(values)
            layer.lazy_initialization(k_all, v_all)
            layer.keys, layer.values = k_all, v_all

    out = model(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=True,
        **{_cache_kwarg(model): cache},
    )
    # The forward pass appended the new positions to `cache` in place.
    new_kv = []
    for b in range(batch):
        n = new_lens[b]
        new_kv.append([(layer.keys[b, :, max_past : max_past + n], layer.values[b, :, max_past : max_past + n]) for layer in cache.layers])
    return out.logits.float(), new_kv


def _cache_kwarg(model) -> str:
    # transformers renamed `past_key_values` to `cache` during 5.x.
    name = "_specfleet_cache_kwarg"
    if not hasattr(model, name):
        params = inspect.signature(model.forward).parameters
        setattr(model, name, "cache" if "cache" in params else "past_key_values")
    return getattr(model, name)


def prefill(loaded: LoadedModel, sessions: list[Session], keep_last: int = 1) -> None:
    """Bring each session's cache up to all but its last `keep_last` tokens, one session at a time.

    Rebuilding a long context inside a batched decode step would pad every other
    session to its length; doing it first keeps the decode batch narrow.
    """
    for session in sessions:
        target = len(session.token_ids) - keep_last
        session.crop_kv(target)
        if session.kv_len == target:
            continue
        ids = session.token_ids[session.kv_len : target]
        positions = list(range(session.kv_len, target))
        _, new_kv = forward_batch(loaded, [ForwardItem(session, ids, positions)])
        session.append_kv(new_kv[0], len(ids))
