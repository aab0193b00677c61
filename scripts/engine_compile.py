"""CPU time of the demo target's forward pass, eager against `torch.compile` of each layer's dense parts.

    PYTHONPATH=. .venv/bin/python scripts/engine_compile.py

The pass is llama.forward's per-session path written out here: each layer's norm, projections and RoPE
(`pre`), and its output projection and MLP (`post`), compiled with dynamic shapes, weights passed as
arguments; attention stays eager (its per-session loop over Python lengths would recompile). Prints each
shape's largest logit difference against `llama.forward` and whether the argmax agrees, the compile time,
then `time.thread_time()` medians (three rounds of 15 passes), one torch thread.
"""

import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

from specfleet.engine import Session, attention, llama, load_model

torch.set_num_threads(1)
MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo" / "target"
loaded = load_model("target", MODEL, attention="per-session")
m = loaded.model


def pre(x, input_norm, qkv_w, eps: float, H: int, KV: int, D: int, cos, sin):
    b, w = x.shape[0], x.shape[1]
    h = F.rms_norm(x, (x.shape[-1],), input_norm, eps)
    qkv = F.linear(h, qkv_w)
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    q, k = q.view(b, w, H, D), k.view(b, w, KV, D)
    q = llama._rotate(q.transpose(1, 2), cos, sin)
    k = llama._rotate(k.transpose(1, 2), cos, sin)
    v = v.view(b, w, KV, D).transpose(1, 2)
    return q, torch.stack([k, v], dim=1)


def post(x, attn, out_w, mlp_norm, gate_up, down, eps: float):
    b, w = x.shape[0], x.shape[1]
    x = x + F.linear(attn.transpose(1, 2).reshape(b, w, -1), out_w)
    h = F.rms_norm(x, (x.shape[-1],), mlp_norm, eps)
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down)


def head(x, norm, lm_head, eps: float):
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps), lm_head)


t0 = time.time()
cpre = torch.compile(pre, dynamic=True)
cpost = torch.compile(post, dynamic=True)
chead = torch.compile(head, dynamic=True)


@torch.inference_mode()
def fwd(input_ids, positions, kv, places, kv_lens, new_lens, attends, compiled):
    batch, width = input_ids.shape
    H, KV, D = m.heads, m.kv_heads, m.head_dim
    x = m.embed[input_ids]
    cos = m.cos[positions].unsqueeze(1)
    sin = m.sin[positions].unsqueeze(1)
    masks = attention._session_masks(m, kv_lens, new_lens, attends)
    P, Q, Hd = (cpre, cpost, chead) if compiled else (pre, post, head)
    for i, layer in enumerate(m.layers):
        q, new_kv = P(x, layer.input_norm, layer.qkv, m.eps, H, KV, D, cos, sin)
        outs = []
        for b in range(batch):
            kv_len, n = kv_lens[b], new_lens[b]
            cache = kv[i, :, :, places[b] : places[b] + kv_len + n]  # consecutive blocks (a fresh pool)
            cache[:, :, kv_len:] = new_kv[b, :, :, :n]
            keys, values = cache[:, None].unbind(0)
            out = F.scaled_dot_product_attention(q[b : b + 1, :, :n], keys, values, attn_mask=masks[b])
            outs.append(out)
        attn = torch.cat(outs)
        x = Q(x, attn, layer.out, layer.mlp_norm, layer.gate_up, layer.down, m.eps)
    return Hd(x, m.norm, m.lm_head, m.eps)


CTX = 128


def setup(b, n):
    ss = []
    for _ in range(b):
        s = Session(token_ids=[1] * CTX)
        s.reserve(loaded.pool, CTX + n, loaded.max_context)
        s.kv_len = CTX
        ss.append(s)
    ids = torch.randint(0, 12000, (b, n))
    pos = torch.arange(CTX, CTX + n).expand(b, n).contiguous()
    places = [s.place() for s in ss]
    attends = [None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril() for _ in range(b)]
    return ss, (ids, pos, loaded.pool.kv, places, [CTX] * b, [n] * b, attends)


shapes = [(1, 1), (1, 5), (4, 1), (4, 5), (16, 1), (16, 5)]
for b, n in shapes:
    ss, a = setup(b, n)
    ref = llama.forward(m, *a[:2], a[2], a[3], a[4], a[5], a[6])
    out = fwd(*a, True)
    print(f"{b}x{n} compiled max diff {(out - ref).abs().max().item():.2e} argmax same {bool((out.argmax(-1) == ref.argmax(-1)).all())}", flush=True)
    for s in ss:
        s.evict_kv()
print("compile s", round(time.time() - t0, 1), flush=True)
res = {}
for rep in range(3):
    for b, n in shapes:
        ss, a = setup(b, n)
        for name, f in (
            ("eager-llama", lambda: llama.forward(m, *a[:2], a[2], a[3], a[4], a[5], a[6])),
            ("piece-eager", lambda: fwd(*a, False)),
            ("piece-compiled", lambda: fwd(*a, True)),
        ):
            for _ in range(3):
                f()
            ts = []
            for _ in range(15):
                t = time.thread_time()
                f()
                ts.append(1e3 * (time.thread_time() - t))
            res.setdefault((b, n, name), []).append(statistics.median(ts))
        for s in ss:
            s.evict_kv()
for b, n in shapes:
    e = statistics.median(res[(b, n, "eager-llama")])
    pe = statistics.median(res[(b, n, "piece-eager")])
    c = statistics.median(res[(b, n, "piece-compiled")])
    print(f"{b}x{n}: eager {e:.2f} piece-eager {pe:.2f} compiled {c:.2f} ms  ratio {e / c:.2f}x")
