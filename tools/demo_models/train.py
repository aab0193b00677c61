"""Target pre-training and drafter distillation (CPU, one thread, resumable)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .corpus import DOMAINS, load_split


# --------------------------------------------------------------------------- model specs


@dataclass
class ModelSpec:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    max_positions: int = 512

    def config(self, tok):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=len(tok),
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            rope_theta=10000.0,
        )


def new_model(spec: ModelSpec, tok, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = spec.config(tok)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------- token streams


def tokenize_corpus(corpus: Path, tok, out: Path, log: Callable[[str], None] = print) -> Path:
    """``out/<domain>_<split>.npy``: uint16 token stream, documents separated by eos."""
    out.mkdir(parents=True, exist_ok=True)
    eos = tok.eos_token_id
    for d in DOMAINS:
        for split in ("train", "heldout", "unseen"):
            f = out / f"{d}_{split}.npy"
            if f.exists():
                continue
            ids: list[int] = []
            for text in load_split(corpus, d, split):
                ids.extend(tok(text, add_special_tokens=False)["input_ids"])
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(f.with_suffix(".tmp.npy"), arr)
            os.replace(f.with_suffix(".tmp.npy"), f)
            log(f"tokens {d}/{split}: {len(arr):,}")
    return out


def load_stream(tokens: Path, domain: str, split: str) -> np.ndarray:
    return np.load(tokens / f"{domain}_{split}.npy")


def sample_windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    if len(stream) <= length:
        reps = length // max(1, len(stream)) + 2
        stream = np.tile(stream, reps)
    starts = rng.integers(0, len(stream) - length, size=n)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


# --------------------------------------------------------------------------- training loop


@dataclass
class TrainBudget:
    max_steps: int
    max_seconds: float
    batch: int
    seq: int
    lr: float
    warmup: int = 30
    weight_decay: float = 0.1
    ckpt_every_s: float = 120.0


def _lr(budget: TrainBudget, step: int, progress: float) -> float:
    if step < budget.warmup:
        return budget.lr * (step + 1) / budget.warmup
    return budget.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_loop(
    model,
    budget: TrainBudget,
    ckpt: Path,
    batch_fn: Callable[[int, np.random.Generator], tuple],
    loss_fn: Callable,
    desc: str,
    progress_cb: Callable[[float, dict], None] | None = None,
    log: Callable[[str], None] = print,
    seed: int = 0,
) -> dict:
    """Generic resumable loop; schedule runs on max(step/max_steps, elapsed/max_seconds)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": budget.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=budget.lr,
        betas=(0.9, 0.95),
    )
    state = {"step": 0, "elapsed": 0.0, "losses": [], "tokens": 0}
    if ckpt.exists():
        blob = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        state = blob["state"]
        log(f"{desc}: resumed at step {state['step']} ({state['elapsed']:.0f}s trained)")
    rng = np.random.default_rng(seed + 7919 * state["step"])
    model.train()

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
        os.replace(tmp, ckpt)

    last_save = time.time()
    ema = None
    while True:
        progress = max(state["step"] / budget.max_steps, state["elapsed"] / budget.max_seconds)
        if progress >= 1.0:
            break
        t0 = time.perf_counter()
        lr = _lr(budget, state["step"], progress)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batch_fn(budget.batch, rng)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        state["step"] += 1
        state["tokens"] += budget.batch * budget.seq
        state["elapsed"] += time.perf_counter() - t0
        if state["step"] % 10 == 0:
            state["losses"].append((state["step"], round(ema, 4)))
        if progress_cb:
            progress_cb(
                max(state["step"] / budget.max_steps, state["elapsed"] / budget.max_seconds),
                {"step": state["step"], "loss": ema, "lr": lr},
            )
        if state["step"] % 50 == 0:
            log(
                f"{desc}: step {state['step']} loss {ema:.3f} lr {lr:.2e} "
                f"{state['tokens'] / max(state['elapsed'], 1e-9):.0f} tok/s elapsed {state['elapsed']:.0f}s"
            )
        if time.time() - last_save > budget.ckpt_every_s:
            save()
            last_save = time.time()
    save()
    model.eval()
    state["final_loss"] = ema if ema is not None else (state["losses"][-1][1] if state["losses"] else float("nan"))
    return state


# --------------------------------------------------------------------------- target


def lm_loss(model, batch):
    (x,) = batch
    x = torch.from_numpy(x)
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))


def mix_batch_fn(streams: dict[str, np.ndarray], seq: int):
    names = sorted(streams)

    def fn(batch: int, rng: np.random.Generator):
        rows = []
        for i in range(batch):
            d = names[int(rng.integers(0, len(names)))]
            rows.append(sample_windows(streams[d], 1, seq + 1, rng)[0])
        return (np.stack(rows),)

    return fn


# --------------------------------------------------------------------------- distillation


@torch.inference_mode()
def cache_teacher(
    target,
    stream: np.ndarray,
    n_seq: int,
    seq: int,
    topk: int,
    out: Path,
    seed: int,
    chunk: int = 8,
    progress_cb: Callable[[float], None] | None = None,
) -> Path:
    """Store target top-k log-probs for ``n_seq`` random windows of ``seq`` tokens (resumable)."""
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    x = sample_windows(stream, n_seq, seq, rng)
    np.save(out / "ids.npy", x.astype(np.uint16))
    target.eval()
    n_chunks = (n_seq + chunk - 1) // chunk
    for c in range(n_chunks):
        f = out / f"part{c:05d}.npz"
        if f.exists():
            continue
        xb = torch.from_numpy(x[c * chunk : (c + 1) * chunk])
        logp = torch.log_softmax(target(input_ids=xb).logits.float(), dim=-1)
        v, i = logp.topk(topk, dim=-1)
        tmp = out / f"part{c:05d}.tmp.npz"
        np.savez(tmp, v=v.to(torch.float16).numpy(), i=i.to(torch.int16).numpy())
        os.replace(tmp, f)
        if progress_cb:
            progress_cb((c + 1) / n_chunks)
    (out / "done").touch()
    return out


def load_teacher_cache(d: Path) -> dict[str, np.ndarray]:
    ids = np.load(d / "ids.npy")
    parts = sorted(d.glob("part*[0-9].npz"))
    vs, is_ = [], []
    for p in parts:
        z = np.load(p)
        vs.append(z["v"])
        is_.append(z["i"])
    return {"ids": ids.astype(np.int64), "v": np.concatenate(vs), "i": np.concatenate(is_).astype(np.int64)}


def distill_batch_fn(caches: list[dict[str, np.ndarray]], weights: list[float] | None = None):
    """Batches of teacher-labelled windows; each row from a cache drawn uniformly, or with ``weights``."""
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)

    def fn(batch: int, rng: np.random.Generator):
        rows = []
        for _ in range(batch):
            c = caches[int(rng.integers(0, len(caches)))] if p is None else caches[int(rng.choice(len(caches), p=p))]
            rows.append((c, int(rng.integers(0, len(c["ids"])))))
        ids = np.stack([c["ids"][j] for c, j in rows])
        v = np.stack([c["v"][j] for c, j in rows]).astype(np.float32)
        i = np.stack([c["i"][j] for c, j in rows])
        return ids, v, i

    return fn


def distill_loss_fn(token_map: torch.Tensor, vocab: int):
    """Cross-entropy to the target's top-k distribution plus a tail bucket (= KL up to a constant).

    The drafter scores only the ids of its token map, as it does when served: its
    distribution is a softmax over those, and the target's probability of every other id
    belongs to the tail, which the drafter can never propose.
    """
    local = torch.full((vocab,), -1, dtype=torch.long)
    local[token_map] = torch.arange(len(token_map))

    def loss_fn(model, batch):
        ids, v, i = batch
        ids = torch.from_numpy(ids)
        p = torch.from_numpy(v).exp()  # (B, T, K) target probs of its top-k tokens
        idx = local[torch.from_numpy(i)]  # (B, T, K) position in the token map, -1 if absent
        mapped = idx >= 0
        h = model.model(input_ids=ids).last_hidden_state
        logq = torch.log_softmax((h @ model.lm_head.weight[token_map].T).float(), dim=-1)
        logq_k = logq.gather(-1, idx.clamp_min(0))
        p_in = p * mapped
        p_tail = (1.0 - p_in.sum(-1)).clamp_min(0.0)
        q_tail = (1.0 - (logq_k.exp() * mapped).sum(-1)).clamp_min(1e-6)
        loss = -(p_in * logq_k).sum(-1) - p_tail * q_tail.log()
        return loss.mean()

    return loss_fn


# --------------------------------------------------------------------------- export


def export_model(model, tok, out_dir: Path, card: str, dtype=torch.bfloat16) -> None:
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    m = model.to(dtype)
    m.config.torch_dtype = dtype
    m.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    m.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    (out_dir / "README.md").write_text(card)
    model.float()


def save_json(path: Path, obj) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # builds may run side by side (--drafters)
    tmp.write_text(json.dumps(obj, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    os.replace(tmp, path)


@torch.no_grad()
def init_embeddings_from_target(drafter, target) -> None:
    """Start the drafter's (tied) embedding from the target's, projected onto its top principal directions."""
    e = target.get_input_embeddings().weight.float()
    d = drafter.get_input_embeddings().weight
    k = d.shape[1]
    if e.shape[0] != d.shape[0] or k > e.shape[1]:
        return
    mean = e.mean(0, keepdim=True)
    u, s, vh = torch.linalg.svd(e - mean, full_matrices=False)
    proj = (e - mean) @ vh[:k].T  # (V, k) coordinates in the top-k principal subspace
    d.copy_(proj.to(d.dtype))
