"""Model runtime shared by drafters and the verifier: loading, session KV caches, batched forward.

A session is a growing list of token ids plus a KV cache for a prefix of them.
Caches extend incrementally, roll back rejected positions, and are evicted
least-recently-used under a memory budget; an evicted cache is rebuilt from
the session's token ids on its next use, so eviction never changes output.

`forward_batch` runs many sessions in one forward pass (`specfleet.llama`):
each session feeds its own new tokens at its own positions with its own
attention pattern among them (causal for a chain, ancestor-only for a token
tree), and the pass writes their keys and values into the session's buffer
just past its cached prefix. The caller then keeps the positions it wants
(`Session.commit`): all of them for a prompt, the accepted path of a tree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specfleet import llama
from specfleet.llama import LlamaModel, check_supported, from_hf

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The config's name of a torch dtype (float32, bfloat16, float16)."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def resolve_device(device: str) -> torch.device:
    """cpu, cuda, cuda:N, or auto (cuda if torch sees one, else cpu); raises ValueError when it does not exist here.

    Services check their config's `device` with `specfleet.config.resolve_device` first, which
    names the setting; this is the same check for direct callers (tests, benchmarks).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device (torch.cuda.is_available() is False)")
    return resolved


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
    model: LlamaModel
    tokenizer: object
    fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_id: int
    parameters: int
    # Draft models only: the vocabulary ids the output layer scores (see `load_model`), or None for all.
    token_map: torch.Tensor | None = None  # [V'] int64, global ids in the order of the logits
    local_index: torch.Tensor | None = None  # [vocab] int64: position in token_map, -1 if absent

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of positions along the logits' last dimension."""
        return local if self.token_map is None else self.token_map[local]

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
            device=str(self.model.device),
            dtype=dtype_name(self.model.dtype),
            attention=self.model.attention,
        )


TOKEN_MAP_FILE = "token_map.json"


def load_model(
    name: str, path: str | os.PathLike, dtype: str = "float32", device: str = "cpu", use_token_map: bool = False,
    attention: str = "per-session",
) -> LoadedModel:
    """Load a Hugging Face Llama-family causal LM and its tokenizer from a local directory, offline.

    use_token_map (drafters only): if the directory has `token_map.json`, a JSON list of
    vocabulary ids, the output layer keeps only those rows (FR-Spec's frequency-ranked
    draft vocabulary; SGLang's speculative token map). On a small drafter the output
    layer is most of a step's cost, and the target's tokens rarely fall outside the few
    thousand most frequent ones. Proposals are then distributions over those ids, which
    is still exactly what they were drawn from, so verification stays lossless; a token
    outside the map can only be reached as the target's correction. The target never
    uses one: its distribution must be whole.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model '{name}': no config.json in {path}; expected a Hugging Face model directory")
    if dtype not in DTYPES:
        raise ValueError(f"model '{name}': dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attention not in llama.ATTENTION_MODES:
        raise ValueError(f"model '{name}': attention must be one of {list(llama.ATTENTION_MODES)}, got {attention!r}")
    try:
        device = resolve_device(str(device))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"model '{name}': {e}") from None
    started = time.perf_counter()
    try:
        check_supported(AutoConfig.from_pretrained(str(path), local_files_only=True))
    except ValueError as e:
        raise ValueError(f"model '{name}' at {path}: {e}") from None
    tokenizer = load_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype])
    hf_model.to(device).eval()
    config = hf_model.config
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    model = from_hf(hf_model)
    model.attention = attention
    token_map = local_index = None
    if use_token_map and (path / TOKEN_MAP_FILE).exists():
        token_map = read_token_map(name, path / TOKEN_MAP_FILE, int(config.vocab_size))
        model.lm_head = model.lm_head[token_map.to(model.device)].contiguous()
        # The maps stay on the CPU: they translate positions of logits that forward_batch
        # hands back on the CPU, where the drafter samples.
        local_index = torch.full((int(config.vocab_size),), -1, dtype=torch.long)
        local_index[token_map] = torch.arange(len(token_map))
    loaded = LoadedModel(
        name=name,
        path=str(path),
        model=model,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=int(config.vocab_size),
        max_context=llama.context_limit(config),
        eos_token_id=int(eos) if eos is not None else -1,
        parameters=sum(p.numel() for p in hf_model.parameters()),
        token_map=token_map,
        local_index=local_index,
    )
    log.info(
        "loaded model %s from %s: %.1fM parameters, %s on %s, %s attention, %s, %.1fs",
        name, path, loaded.parameters / 1e6, dtype, _describe_device(model.device), attention,
        f"output layer over {len(token_map)} ids ({TOKEN_MAP_FILE})" if token_map is not None else "full output layer",
        time.perf_counter() - started,
    )
    return loaded


def _describe_device(device: torch.device) -> str:
    """cpu, or cuda:N with the card's name (what the start-up log says)."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def read_token_map(name: str, path: pathlib.Path, vocab_size: int) -> torch.Tensor:
    """A token_map.json's ids, checked: raises ValueError naming the model and the file."""
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model '{name}': cannot read {path}: {err}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"model '{name}': {path} must be a non-empty JSON list of vocabulary ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"model '{name}': {path} lists some ids twice")
    return torch.tensor(ids, dtype=torch.long)


# --- sessions -------------------------------------------------------------------------------------------------


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # [layers, 2, KV heads, capacity, head dim]; positions [0, kv_len) hold the KV of
    # token_ids[:kv_len]. Spare capacity makes appending a write, not a copy.
    kv: torch.Tensor | None = None

    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        self.kv_len = min(self.kv_len, length)

    def reserve(self, model: LlamaModel, count: int) -> None:
        """Make room for `count` positions past the cached prefix."""
        needed = self.kv_len + count
        if self.kv is not None and needed <= self.kv.shape[3]:
            return
        # Doubling keeps appends amortised O(1) per position.
        capacity = max(64, 1 << (needed - 1).bit_length())
        # Zeros, not empty: the batched attention path reads (masked) positions past a session's end.
        grown = torch.zeros(
            model.num_layers, 2, model.kv_heads, capacity, model.head_dim, dtype=model.dtype, device=model.device
        )
        if self.kv is not None and self.kv_len:
            grown[:, :, :, : self.kv_len] = self.kv[:, :, :, : self.kv_len]
        self.kv = grown

    def commit(self, rows: list[int]) -> None:
        """Keep these of the positions the last forward pass wrote past the cached prefix, in this order."""
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=self.kv.device) + self.kv_len
            self.kv[:, :, :, self.kv_len : self.kv_len + len(rows)] = self.kv[:, :, :, src]
        self.kv_len += len(rows)

    def evict_kv(self) -> None:
        self.kv = None
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


def forward_batch(loaded: LoadedModel, items: list[ForwardItem], logits: bool = True, host: bool = True) -> torch.Tensor | None:
    """One forward pass over many sessions: logits [B, N, V] float32 (row b valid for its first n_b positions).

    V is the vocabulary, or the token map's ids in its order when the model has one
    (`LoadedModel.global_ids` turns positions into vocabulary ids). With `host` the logits
    come back on the CPU, where the verifier and the drafter shape and sample them today;
    `host=False` leaves them on the model's device.

    Each session's new KV is written just past its cached prefix and is not yet
    part of it: the caller keeps what it wants with `Session.commit`.
    """
    model = loaded.model
    new_lens = [len(it.input_ids) for it in items]
    width = max(new_lens)
    # Padded in Python lists and sent to the device once: a tensor op per session costs more.
    ids_rows, pos_rows, attends = [], [], []
    # Batched attention stacks every buffer to the batch's longest context: each must hold that many.
    total = max(it.session.kv_len + n for it, n in zip(items, new_lens)) if model.attention == "batched" else 0
    for it, n in zip(items, new_lens):
        ids_rows.append(list(it.input_ids) + [0] * (width - n))
        pos_rows.append(list(it.positions) + [0] * (width - n))
        it.session.reserve(model, max(n, total - it.session.kv_len))
        if n == 1:
            attends.append(None)
        else:
            attends.append(it.attend if it.attend is not None else torch.ones(n, n, dtype=torch.bool, device=model.device).tril())
    out = llama.forward(
        model,
        torch.tensor(ids_rows, dtype=torch.long, device=model.device),
        torch.tensor(pos_rows, dtype=torch.long, device=model.device),
        [it.session.kv for it in items],
        [it.session.kv_len for it in items],
        new_lens,
        attends,
        logits=logits,
    )
    if out is None:
        return None
    return out.float().cpu() if host else out.float()


# Rows of one prefill pass at most (bounds the [rows, V] logits a scored pass holds).
_PREFILL_ROWS = 2048


def prefill(loaded: LoadedModel, sessions: list[Session], keep_last: int = 1, score: bool = False) -> list[tuple[float, int]]:
    """Bring each session's cache up to all but its last `keep_last` tokens.

    Sessions are prefilled together in passes of similar lengths (padding at most
    a quarter of a pass's rows), apart from any decode step: rebuilding a long
    context inside a batched decode step would pad every other session to its
    length. With `score`, also returns per session (sum of log-probabilities,
    count) of each prefilled token's successor given what precedes it: how well
    the model knows this text. Without it, the pass skips the vocabulary projection.
    """
    scores = [(0.0, 0)] * len(sessions)
    todo = []  # (index, session, first position to prefill, end)
    for i, session in enumerate(sessions):
        end = len(session.token_ids) - keep_last
        session.crop_kv(end)
        if session.kv_len < end:
            todo.append((i, session, session.kv_len, end))
    todo.sort(key=lambda t: t[3] - t[2])
    passes: list[list] = []
    rows = 0  # real (unpadded) rows of the last pass
    for t in todo:
        n = t[3] - t[2]
        # Sorted by length, so n is the widest of the pass: with t, its padded rows are (len + 1) * n.
        padded = (len(passes[-1]) + 1) * n if passes else 0
        if passes and padded <= 1.25 * (rows + n) and padded <= _PREFILL_ROWS:
            passes[-1].append(t)
            rows += n
        else:
            passes.append([t])
            rows = n
    for group in passes:
        items = [ForwardItem(session, session.token_ids[start:end], list(range(start, end))) for _, session, start, end in group]
        logits = forward_batch(loaded, items, logits=score)
        for b, (i, session, start, end) in enumerate(group):
            session.commit(list(range(end - start)))
            if score:
                scores[i] = _score(loaded, logits[b, : end - start], session.token_ids[start + 1 : end + 1])
    return scores


def _score(loaded: LoadedModel, logits: torch.Tensor, successors: list[int]) -> tuple[float, int]:
    """(sum of log-probabilities of `successors` under `logits` [n, V], n)."""
    successors = torch.tensor(successors)
    log_probs = logits.log_softmax(dim=-1)
    if loaded.token_map is None:
        log_probs = log_probs.gather(1, successors.unsqueeze(1))
    else:
        # A successor outside the token map is one the model cannot propose: it scores as
        # unlikely as the model's least likely mapped token.
        local = loaded.local_index[successors]
        log_probs = torch.where(
            local >= 0, log_probs.gather(1, local.clamp(min=0).unsqueeze(1)).squeeze(1), log_probs.min(dim=1).values
        )
    return float(log_probs.sum()), len(successors)
